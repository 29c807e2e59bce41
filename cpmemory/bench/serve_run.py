"""The replay behind ``cpmemory bench serve``: concurrent, streamed clients, one strategy after the other.

Per strategy: the engines' prefix caches are emptied (``POST /reset_prefix_cache``), then the selected sessions are
replayed by that strategy's client (:mod:`cpmemory.bench.serve_clients`):

* ``concurrency`` C: C clients; each takes the next session and plays its turns in order (a multi-turn session's
  turn n+1 is sent when turn n has answered), so C sessions are interleaved at any time;
* ``rate`` R: requests arrive as a Poisson process of R per second in trace order; a turn is sent at its arrival
  time or when its session's previous turn answered, whichever is later.

Every request has a deadline (``timeout_s``): past it the request is cancelled and counted as an error, so no client
waits longer. A failed turn is reported (kind and a sample of messages) and its session goes on with the next turn.
After the run, every answered request is checked with ``check_no_loss`` on the messages that reached the engine.
"""
from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cpmemory.bench.prompts import PreparedRequest, prepare_requests
from cpmemory.bench.trace import Trace, TraceRequest
from cpmemory.errors import InvalidInputError

STRATEGIES = ("original", "cpmemory")
PROXY_ABLATIONS = ("cpmemory-nofit", "cpmemory-nomove", "cpmemory-nosplit", "cpmemory-nohold", "cpmemory-nopick")
"""Strategies that start their own in-process proxy with one part of it off (never with ``--proxy``)."""
KNOWN_STRATEGIES = (*STRATEGIES, *PROXY_ABLATIONS, "original-priority")
"""``cpmemory-nofit``: the in-process proxy with cache-fit admission off (cpmemory.server.fit); ``cpmemory-nomove``:
admission on without its moves (``CacheFit`` ``move``); ``cpmemory-nosplit``: the hold queue without its split of a
window over the replicas (``experimental.hold_split``); ``cpmemory-nohold``: the proxy without the hold queue that
``--hold`` turns on for the others (nothing held); ``cpmemory-nopick``: the hold queue releasing whole windows
with the pick's bounds, where ``--hold pick`` has the others pick one request per free replica; ``original-priority``: ``original`` whose requests carry
vLLM's ``priority`` by the same rule as the proxy's ``engine_priority`` without a view of the caches (the tokens
after the conversation's last answer: shortest new prompt first); all for ablations."""
FIGURES = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "latency_mean_ms", "throughput_rps", "prompt_tokens_per_s",
           "cached_tokens", "prompt_tokens", "errors", "lost_blocks")


class ServeSettings(BaseModel):
    """How ``bench serve`` replays (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engines: tuple[str, ...] = Field(min_length=1, description="engine base URLs (caches reset per strategy)")
    upstream: str | None = Field(None, description="a router in front of the engines: both strategies send there")
    proxy: str | None = Field(None, description="a running cpmemory proxy; None starts one in this process")
    kv_events: tuple[str, ...] = Field((), description="KV-event endpoint per engine, for the in-process proxy")
    upstream_session: bool = Field(False, description="both strategies name each conversation to --upstream")
    original_routing: Literal["session", "hash"] = Field(
        "session", description="original's conversation affinity: least loaded then sticky, or rendezvous hash")
    tokenizer: str | None = Field(None, description="the in-process proxy's local tokenizer (cpmemory serve --tokenizer)")
    upstream_kind: str | None = Field(None, description="the in-process proxy's --upstream-kind (None: generic)")
    hold: Literal["off", "window", "pick"] | None = Field(
        None, description="the in-process proxy's --hold (None: the config's, else off)")
    proxy_config: dict[str, Any] = Field(
        default_factory=dict, description="the in-process proxy's settings (a --config file's tree, "
        "cpmemory.server.config.ServerConfig); the engines, upstream and flags above go over it")
    concurrency: int = Field(8, ge=1, le=4096)
    rate: float | None = Field(None, gt=0, description="Poisson arrivals per second (instead of concurrency)")
    requests: int = Field(64, ge=1)
    max_turns: int | None = Field(None, ge=1, description="turns kept per session (the first ones)")
    max_tokens: int = Field(8, ge=1)
    timeout_s: float = Field(300.0, gt=0, description="deadline of one request")
    engine_timeout_s: float = Field(120.0, gt=0, description="per-call engine timeout before a replica fails over")
    model: str = "tiny"
    strategies: tuple[str, ...] = STRATEGIES
    seed: int = 0
    rounds: int = Field(1, ge=1, le=10, description="repeat the strategies, odd rounds in reverse order; pooled")


@dataclass(frozen=True, slots=True)
class Job:
    """One request to replay: the trace request, its blocks, its conversation id, its arrival (rate mode)."""

    request: TraceRequest
    prepared: PreparedRequest
    conversation: str
    arrival_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's result: figures when answered, ``error`` otherwise."""

    job: Job
    started_s: float
    ttft_ms: float | None = None
    latency_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: int = -1
    messages: tuple[Any, ...] | None = None
    error: str | None = None
    failovers: int = 0
    fit: tuple[str, float] | None = None  # the proxy's cache-fit admission: reason, wait (ms)


@dataclass(slots=True)
class StrategyRun:
    """Everything one strategy's replay observed."""

    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    reset: dict[str, bool] = field(default_factory=dict)
    lost_blocks: int = 0
    unchecked: int = 0
    loss_samples: list[str] = field(default_factory=list)
    load_average: list[tuple[float, float]] = field(default_factory=list)
    engine_raw: dict[str, float] | None = None  # the engines' counters over the replay (serve_metrics.delta)
    proxy_raw: dict[str, float] | None = None  # the proxy's, for the cpmemory strategy
    rounds: int = 0
    failover_samples: list[str] = field(default_factory=list)  # the direct client's causes of failovers

    def merge(self, other: StrategyRun) -> None:
        """Pool another round of the same strategy into this one (outcomes, wall time, losses, resets, load,
        engine and proxy counters)."""
        from cpmemory.bench.serve_metrics import add

        self.engine_raw = add(self.engine_raw, other.engine_raw, first=self.rounds == 0)
        self.proxy_raw = add(self.proxy_raw, other.proxy_raw, first=self.rounds == 0)
        self.rounds += 1
        self.outcomes.extend(other.outcomes)
        self.failover_samples.extend(other.failover_samples)
        self.wall_s += other.wall_s
        self.lost_blocks += other.lost_blocks
        self.unchecked += other.unchecked
        self.loss_samples.extend(other.loss_samples)
        for url, done in other.reset.items():
            self.reset[url] = self.reset.get(url, True) and done
        self.load_average.extend(other.load_average)

    def answered(self) -> list[Outcome]:
        """Outcomes without an error."""
        return [outcome for outcome in self.outcomes if outcome.error is None]

    def figures(self) -> dict[str, Any]:
        """The per-strategy JSON object (exactly :data:`FIGURES`)."""
        ok = self.answered()
        ttfts = [o.ttft_ms for o in ok if o.ttft_ms is not None]
        latencies = [o.latency_ms for o in ok if o.latency_ms is not None]
        prompt = sum(o.prompt_tokens for o in ok)
        wall = self.wall_s or math.inf
        return {
            "ttft_mean_ms": round(statistics.fmean(ttfts), 2) if ttfts else None,
            "ttft_p50_ms": round(percentile(ttfts, 0.5), 2) if ttfts else None,
            "ttft_p90_ms": round(percentile(ttfts, 0.9), 2) if ttfts else None,
            "latency_mean_ms": round(statistics.fmean(latencies), 2) if latencies else None,
            "throughput_rps": round(len(ok) / wall, 4), "prompt_tokens_per_s": round(prompt / wall, 1),
            "cached_tokens": sum(o.cached_tokens for o in ok), "prompt_tokens": prompt,
            "errors": len(self.outcomes) - len(ok), "lost_blocks": self.lost_blocks,
        }

    def details(self) -> dict[str, Any]:
        """What the figures do not say: counts, failures by kind, replicas used, working set, resets, where the
        time went (the engines' queue and prefill, the proxy's routing; :mod:`cpmemory.bench.serve_metrics`)."""
        from cpmemory.bench.serve_metrics import engine_summary, proxy_summary

        errors = [o.error for o in self.outcomes if o.error is not None]
        kinds = Counter(error.split(":", 1)[0] for error in errors)
        replicas = Counter(str(o.replica) for o in self.answered())
        return {"requests": len(self.outcomes), "answered": len(self.answered()), "wall_s": round(self.wall_s, 2),
                "errors_by_kind": dict(kinds), "error_samples": list(dict.fromkeys(errors))[:5],
                "requests_per_replica": dict(sorted(replicas.items())), "unchecked": self.unchecked,
                "loss_samples": self.loss_samples[:5], "reset": self.reset,
                "replica_changes": replica_changes(self.outcomes),
                "failovers": sum(o.failovers for o in self.outcomes), "failover_samples": self.failover_samples[:5],
                "working_set_tokens": working_set(self.outcomes),
                "peak_working_set_tokens": peak_working_set(self.outcomes),
                "machine_load_average": [[round(a, 2), round(b, 2)] for a, b in self.load_average],
                "engine": engine_summary(self.engine_raw), "proxy": proxy_summary(self.proxy_raw)}

    def by_turn(self) -> dict[str, dict[str, Any]]:
        """Per turn number of the sessions (multi-turn traces): requests, mean TTFT, prompt and cached tokens."""
        rows: dict[int, list[Outcome]] = {}
        for outcome in self.answered():
            rows.setdefault(outcome.job.request.turn, []).append(outcome)
        out = {}
        for turn, group in sorted(rows.items()):
            ttfts = [o.ttft_ms for o in group if o.ttft_ms is not None]
            out[str(turn)] = {"requests": len(group),
                              "ttft_mean_ms": round(statistics.fmean(ttfts), 1) if ttfts else None,
                              "prompt_tokens": sum(o.prompt_tokens for o in group),
                              "cached_tokens": sum(o.cached_tokens for o in group)}
        return out


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def replica_changes(outcomes: Sequence[Outcome]) -> int:
    """Answered turns sent to another replica than their conversation's previous answered turn (a history left
    behind in the other replica's cache); 0 for independent requests."""
    last: dict[str, int] = {}
    changes = 0
    for o in sorted((o for o in outcomes if o.error is None), key=lambda o: o.started_s):
        previous = last.get(o.job.conversation)
        changes += previous is not None and previous != o.replica
        last[o.job.conversation] = o.replica
    return changes


def working_set(outcomes: Sequence[Outcome]) -> int:
    """Sum over sessions of each one's largest prompt (tokens): what the caches must hold to keep every session's
    history for the whole run (for independent requests: every prompt)."""
    largest: dict[str, int] = {}
    for o in outcomes:
        if o.error is None:
            largest[o.job.conversation] = max(largest.get(o.job.conversation, 0), o.prompt_tokens)
    return sum(largest.values())


def peak_working_set(outcomes: Sequence[Outcome]) -> int:
    """The largest sum, over sessions active at one time, of each one's latest prompt tokens (what the engines'
    caches must hold to reuse every session's history): a session is active from its first request's start to its
    last request's end."""
    spans: dict[str, list[float]] = {}
    latest: dict[str, list[tuple[float, int]]] = {}
    for o in outcomes:
        if o.error is not None or o.latency_ms is None:
            continue
        key = o.job.request.session
        end = o.started_s + o.latency_ms / 1000.0
        span = spans.setdefault(key, [o.started_s, end])
        span[0], span[1] = min(span[0], o.started_s), max(span[1], end)
        latest.setdefault(key, []).append((end, o.prompt_tokens))
    events = sorted((t, key) for key, rows in latest.items() for t, _ in rows)
    peak = 0
    for now, _key in events:
        total = 0
        for session, (start, end) in spans.items():
            if start <= now <= end:
                total += max((tokens for t, tokens in latest[session] if t <= now), default=0)
        peak = max(peak, total)
    return peak


# ---------------------------------------------------------------- selection

def select_jobs(trace: Trace, settings: ServeSettings, run_id: str) -> list[list[Job]]:
    """The sessions to replay, each a list of jobs in turn order, in order of first appearance in the trace.

    Whole sessions are taken until ``settings.requests`` requests are reached (the last one is cut to fit); a
    session keeps at most ``max_turns`` turns. An independent trace gets one conversation per request. With a
    rate, arrival times are a seeded Poisson process over the requests in trace order.
    """
    prepared = prepare_requests(trace)
    sessions: dict[str, list[tuple[TraceRequest, PreparedRequest]]] = {}
    for request, item in zip(trace.requests, prepared):
        sessions.setdefault(request.session, []).append((request, item))
    chosen: list[list[tuple[TraceRequest, PreparedRequest]]] = []
    total = 0
    for turns in sessions.values():
        if total >= settings.requests:
            break
        turns = turns[: settings.max_turns] if trace.multi_turn else turns
        turns = turns[: settings.requests - total]
        chosen.append(turns)
        total += len(turns)
    arrivals = _arrivals(trace, chosen, settings)
    jobs = []
    for turns in chosen:
        row: list[Job] = []
        for request, item in turns:
            conversation = f"{run_id}:{request.session}"
            if not trace.multi_turn:
                conversation += f"#{request.turn}:{len(row)}"
            row.append(Job(request, item, conversation, arrivals.get(id(request), 0.0)))
        jobs.append(row)
    return jobs


def _arrivals(trace: Trace, chosen: Sequence[Sequence[tuple[TraceRequest, Any]]],
              settings: ServeSettings) -> dict[int, float]:
    if settings.rate is None:
        return {}
    wanted = {id(request) for turns in chosen for request, _ in turns}
    rng = random.Random(settings.seed)
    clock, out = 0.0, {}
    for request in trace.requests:
        if id(request) in wanted:
            out[id(request)] = clock
            clock += rng.expovariate(settings.rate)
    return out


# ---------------------------------------------------------------- the replay

Progress = Callable[[Outcome], None]


async def _one(client: Any, job: Job, multi_turn: bool, timeout_s: float, epoch: float) -> Outcome:
    started = time.perf_counter()
    try:
        sent = await asyncio.wait_for(client.send(job.conversation, job.prepared.blocks, job.request.query,
                                                  multi_turn), timeout=timeout_s)
    except asyncio.TimeoutError:
        return Outcome(job, started - epoch, error=f"timeout: no answer within {timeout_s:g} s")
    except Exception as error:  # noqa: BLE001 - every failure of a request is reported, none stops the run
        return Outcome(job, started - epoch, error=f"{type(error).__name__}: {str(error)[:300]}")
    ttft = None if sent.ttft_s is None else sent.ttft_s * 1000.0
    return Outcome(job, started - epoch, ttft, sent.latency_s * 1000.0, sent.prompt_tokens, sent.cached_tokens,
                   sent.replica, sent.messages, failovers=sent.failovers, fit=sent.fit)


async def replay(client: Any, sessions: Sequence[Sequence[Job]], multi_turn: bool, settings: ServeSettings,
                 progress: Progress | None = None) -> tuple[list[Outcome], float]:
    """Replay ``sessions`` through ``client`` (concurrency or rate, see the module docstring).

    Returns the outcomes (completion order) and the wall time in seconds.
    """
    outcomes: list[Outcome] = []
    epoch = time.perf_counter()

    async def play(session: Sequence[Job]) -> None:
        for job in session:
            if settings.rate is not None:
                await asyncio.sleep(max(0.0, epoch + job.arrival_s - time.perf_counter()))
            outcome = await _one(client, job, multi_turn, settings.timeout_s, epoch)
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome)

    if settings.rate is not None:
        await asyncio.gather(*(play(session) for session in sessions))
    else:
        queue = list(sessions)[::-1]

        async def worker() -> None:
            while queue:
                await play(queue.pop())

        await asyncio.gather(*(worker() for _ in range(min(settings.concurrency, len(sessions)))))
    return outcomes, time.perf_counter() - epoch


def request_record(strategy: str, outcome: Outcome, rate: float | None = None) -> dict[str, Any]:
    """One request of a run as ``bench serve --per-request`` writes it (a JSON Lines row): which strategy and
    conversation, the turn, the replica that served it, when it was sent (seconds from the run's start), TTFT and
    latency, the engine's prompt and cached tokens and their share, failovers, the proxy's cache-fit admission (``fit``:
    its reason, ``fit_wait_ms``: how long the turn waited; None when it did not gate), and the error if it failed. This is
    where a run's mean comes from: which turns paid their whole prompt (``cached_share`` 0 on a later turn: its
    history was evicted or it moved replica), which replica each went to, in which order."""
    record: dict[str, Any] = {
        "strategy": strategy, "conversation": outcome.job.conversation, "session": outcome.job.request.session,
        "turn": outcome.job.request.turn, "blocks": len(outcome.job.request.blocks), "replica": outcome.replica,
        "started_s": round(outcome.started_s, 4),
        "ttft_ms": None if outcome.ttft_ms is None else round(outcome.ttft_ms, 2),
        "latency_ms": None if outcome.latency_ms is None else round(outcome.latency_ms, 2),
        "prompt_tokens": outcome.prompt_tokens, "cached_tokens": outcome.cached_tokens,
        "cached_share": round(outcome.cached_tokens / outcome.prompt_tokens, 4) if outcome.prompt_tokens else None,
        "failovers": outcome.failovers, "error": outcome.error,
        "fit": outcome.fit[0] if outcome.fit else None, "fit_wait_ms": outcome.fit[1] if outcome.fit else None,
    }
    if rate is not None:
        record["rate"] = rate
    return record


def check_losses(run: StrategyRun) -> None:
    """``check_no_loss`` on what reached the engine for every answered request; fills ``run``'s loss fields."""
    from cpmemory.core.invariants import check_no_loss

    for outcome in run.answered():
        if outcome.messages is None:
            run.unchecked += 1
            continue
        report = check_no_loss(list(outcome.job.prepared.blocks), list(outcome.messages))
        run.lost_blocks += len(report.violations)
        run.loss_samples.extend(f"{outcome.job.conversation}: {v}" for v in report.violations[:2])


def validate(settings: ServeSettings) -> None:
    """Raise InvalidInputError for strategies this benchmark does not know."""
    unknown = set(settings.strategies) - set(KNOWN_STRATEGIES)
    if unknown or not settings.strategies:
        raise InvalidInputError(f"unknown strategies {sorted(unknown)}; choose from {', '.join(KNOWN_STRATEGIES)}")
    for own in PROXY_ABLATIONS:
        if settings.proxy is not None and own in settings.strategies:
            raise InvalidInputError(f"{own} starts its own proxy: it cannot run with --proxy")
    if settings.proxy is not None and (settings.hold is not None or settings.proxy_config
                                       or settings.upstream_kind is not None):
        raise InvalidInputError("--hold, --upstream-kind and --config set the in-process proxy: give them to the "
                                "running proxy (cpmemory serve)")
    if "cpmemory-nopick" in settings.strategies and settings.hold != "pick":
        raise InvalidInputError("cpmemory-nopick compares the pick with windows: it needs --hold pick")
