"""``cpmemory bench replay --online``: requests ordered as they arrive, the path every integration takes.

Requests come in trace order (or by ``arrival``). ``window`` W bounds how many may wait and be ordered together:

* without ``arrival`` times, the trace is cut into consecutive windows of W requests (W=1: pure online);
* with ``arrival`` times, a window is what arrived while the engine was busy with the previous one (at least the
  next arrival), bounded by W; the engine is busy ``prefill tokens / PREFILL_TOKENS_PER_S`` per request.

Each online strategy decides, for every window, the execution order and each request's block order, knowing only
what arrived so far; the prompts run through a fresh ``PrefixCacheSimulator`` (the offline replay's capacity):

* ``original``: relevance order, first come first served;
* ``original+lpm``: relevance order; the engine's longest-prefix-match over the window (exact: it asks the cache);
* ``popularity``: blocks by how often they were retrieved so far, FCFS;
* ``trie``: a trie of the block orders sent; a request descends from the root into the child whose block it holds
  that most requests went through; its other blocks follow by frequency so far (the issue's simple rule);
* ``cpmemory``: the product. W=1: ``CpMemory.prepare`` (no ``prompt_order``) then ``commit``, exactly as the
  integrations call it; W>1: ``CpMemory.release_order`` (the proxy's hold-and-release order, told the cache size) first.

``gain_share`` = (hit rate - online ``original``) / (offline ``cpmemory`` - ``original``), same run;
``gain_share_second_half`` the same over the requests of the trace's second half (by arrival position, each
strategy's hit and prompt tokens of those requests wherever it ran them; the cache is warm from the first half):
a share that rises there was lost to warm-up, one that does not is structural.

With ``fleet`` (``--replicas N [--router prefix|affinity]``), each strategy runs on N simulated caches of
``capacity / N`` behind the product's router instead of one cache (:mod:`cpmemory_benchmarks.replicas`); every strategy
then also reports ``replica_load_max_over_mean`` and a ``replicas`` object (per-replica requests and hit rates,
route decisions by reason). A multi-turn session is the router's conversation key (its later turns are sticky).
"""
from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cpmemory.bench.offline import keep_turn_order
from cpmemory.bench.prompts import FacadePromptBuilder, PlainPromptBuilder, PreparedRequest, chat_tokens
from cpmemory.bench.results import StrategyResult
from cpmemory.bench.simulator import SimulatorMode
from cpmemory.bench.trace import Trace
from cpmemory.errors import InvalidInputError

ONLINE_STRATEGIES = ("original", "original+lpm", "popularity", "trie", "cpmemory")
PREFILL_TOKENS_PER_S = 20_000.0


def check_window(window: int) -> int:
    """Return ``window`` or raise InvalidInputError naming ``--window``."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidInputError(f"--window must be an integer >= 1, got {window!r}")
    return window


# ---------------------------------------------------------------- windows

class Windows:
    """The windows of requests a strategy sees (see the module docstring). Mutated by :meth:`next_window`."""

    def __init__(self, trace: Trace, window: int) -> None:
        """Cut ``trace`` into windows of at most ``window`` requests."""
        self.window = check_window(window)
        arrivals = [request.arrival for request in trace.requests]
        self.requests = len(arrivals)
        # arrival times only when every request has one (a trace without them is cut into windows of W)
        self.arrivals: list[float] = [a for a in arrivals if a is not None]
        self.timed = bool(arrivals) and len(self.arrivals) == len(arrivals)
        self.sessions = trace.sessions
        self.next_index = 0
        self.free_at = 0.0

    def __iter__(self) -> Iterator[list[int]]:
        """Yield windows until every request was handed out (call :meth:`busy` as requests run)."""
        total = self.requests
        while self.next_index < total:
            start = self.next_index
            end = min(total, start + self.window)
            if self.timed:
                self.free_at = max(self.free_at, self.arrivals[start])
                stop = start + 1
                while stop < end and self.arrivals[stop] <= self.free_at:
                    stop += 1
                end = stop
            self.next_index = end
            yield list(range(start, end))

    def busy(self, prefill_tokens: int) -> None:
        """The engine ran a request that prefilled ``prefill_tokens`` (advances the clock of timed traces)."""
        self.free_at += prefill_tokens / PREFILL_TOKENS_PER_S


# ---------------------------------------------------------------- strategies

class OnlineStrategy(Protocol):
    """An online strategy: it sees one window at a time and remembers what it did (``decision_ms``: the time the
    last :meth:`build` spent deciding)."""

    decision_ms: float

    def schedule(self, window: Sequence[int]) -> list[int]:
        """Execution order of the waiting requests (a permutation of ``window``)."""
        ...

    def build(self, index: int) -> dict[str, Any]:
        """Decide request ``index``'s prompt now (it runs next); return the replay builder's dict."""
        ...


@dataclass(slots=True)
class _Context:
    trace: Trace
    prepared: Sequence[PreparedRequest]
    system_prompt: str
    simulator: Any = None
    workers: tuple[str, int, str] | None = None  # (Redis URL, K facades, key prefix) for the product


class _Plain:
    """Shared part of the baselines: FCFS, plain prompts, a block order decided by :meth:`order`."""

    def __init__(self, context: _Context) -> None:
        self.context = context
        self.builder = PlainPromptBuilder(context.system_prompt, context.trace.multi_turn)
        self.decision_ms = 0.0

    def schedule(self, window: Sequence[int]) -> list[int]:
        return list(window)

    def order(self, index: int) -> list[str]:
        return list(self.context.prepared[index].keys)

    def build(self, index: int) -> dict[str, Any]:
        started = time.perf_counter()
        keys = self.order(index)
        self.decision_ms = (time.perf_counter() - started) * 1000.0
        return self.builder.build(self.context.trace.requests[index], self.context.prepared[index], keys)


class _LongestPrefix(_Plain):
    """Relevance order; the engine runs the waiting request with the longest cached prefix first."""

    def schedule(self, window: Sequence[int]) -> list[int]:
        if len(window) == 1:
            return list(window)
        trace, prepared = self.context.trace, self.context.prepared
        probe = PlainPromptBuilder(self.context.system_prompt, False)  # the history is the same for every order
        tokens = {i: chat_tokens(probe.build(trace.requests[i], prepared[i], prepared[i].keys)["messages"])
                  for i in window}
        simulator = self.context.simulator
        # The scheduler picks once per window from the cache as it is (SGLang sorts its waiting queue per batch).
        ranked = sorted(window, key=lambda i: (-simulator.peek(tokens[i]), i))
        return keep_turn_order(ranked, [trace.sessions[i] for i in ranked]) if trace.multi_turn else ranked


class _Popularity(_Plain):
    """Blocks by retrieval frequency so far (the window's requests have arrived, so they count)."""

    def __init__(self, context: _Context) -> None:
        super().__init__(context)
        self.frequency: Counter[str] = Counter()
        self.first_seen: dict[str, int] = {}

    def schedule(self, window: Sequence[int]) -> list[int]:
        for index in window:
            for key in self.context.prepared[index].keys:
                self.frequency[key] += 1
                self.first_seen.setdefault(key, len(self.first_seen))
        return list(window)

    def order(self, index: int) -> list[str]:
        frequency, first = self.frequency, self.first_seen
        return sorted(self.context.prepared[index].keys, key=lambda key: (-frequency[key], first[key]))


class _Trie(_Popularity):
    """The issue's simple rule: descend the trie of sent orders by the most travelled child the request holds."""

    def __init__(self, context: _Context) -> None:
        super().__init__(context)
        self.root: dict[str, list[Any]] = {}  # key -> [count, children]

    def order(self, index: int) -> list[str]:
        keys = set(self.context.prepared[index].keys)
        node, path = self.root, []
        while True:
            best = max(((entry[0], key) for key, entry in node.items() if key in keys and key not in path),
                       default=None, key=lambda item: item[0])
            if best is None:
                break
            path.append(best[1])
            node = node[best[1]][1]
        placed = set(path)
        rest = [key for key in super().order(index) if key not in placed]
        node = self.root
        for key in path + rest:
            entry = node.setdefault(key, [0, {}])
            entry[0] += 1
            node = entry[1]
        return path + rest


class _Facade:
    """The product: ``release_order`` for a window, then ``prepare`` (no prompt_order) and ``commit`` per request.

    With ``workers`` (a Redis URL and K), K facades on one Redis store and prefix take the requests round robin,
    as K workers of one deployment would.
    """

    def __init__(self, context: _Context) -> None:
        self.context = context
        trace = context.trace
        if context.workers is None:
            self.builders = [FacadePromptBuilder(context.system_prompt, trace.multi_turn)]
        else:
            from cpmemory.stores.redis_store import RedisSessionStore, RedisStoreConfig

            url, count, prefix = context.workers
            config = RedisStoreConfig(prefix=prefix, ttl_s=3600.0)
            self.builders = [FacadePromptBuilder(context.system_prompt, trace.multi_turn,
                                                 RedisSessionStore.from_url(url, config)) for _ in range(count)]
        self.builder = self.builders[0]
        self.requests_built = 0
        self.decision_ms = 0.0

    def schedule(self, window: Sequence[int]) -> list[int]:
        if len(window) == 1:
            return list(window)
        prepared = self.context.prepared
        order = self.builder.memory.release_order([list(prepared[i].blocks) for i in window],
                                                  cache_tokens=_cache_tokens(self.context.simulator))
        ranked = [window[position] for position in order]
        trace = self.context.trace
        return keep_turn_order(ranked, [trace.sessions[i] for i in ranked]) if trace.multi_turn else ranked

    def build(self, index: int) -> dict[str, Any]:
        builder = self.builders[self.requests_built % len(self.builders)]
        builder._count = self.requests_built  # conversation names stay unique across workers
        self.requests_built += 1
        built = builder.build_online(self.context.trace.requests[index], self.context.prepared[index])
        self.decision_ms = builder.middleware_ms  # prepare + commit, not the replay's own token counting
        return built


def _cache_tokens(simulator: Any) -> int | None:
    """What the product's window planner is told the engine caches: the simulated cache (a fleet's N caches
    together, over which a window's requests spread), as the proxy knows its replicas' KV cache sizes."""
    if simulator is None:
        return None
    caches = getattr(simulator, "caches", None)
    if caches is not None:
        return sum(int(cache.capacity_tokens) for cache in caches)
    return int(simulator.capacity_tokens)


ONLINE_FACTORIES: dict[str, Callable[[_Context], OnlineStrategy]] = {
    "original": _Plain,
    "original+lpm": _LongestPrefix,
    "popularity": _Popularity,
    "trie": _Trie,
    "cpmemory": _Facade,
}


# ---------------------------------------------------------------- the run

@dataclass(slots=True)
class OnlineReport:
    """What the online replay measured (one window size, every online strategy)."""

    window: int
    results: dict[str, StrategyResult]
    offline_cpmemory: float
    offline_original: float
    gain_shares: dict[str, float] = field(default_factory=dict)
    hit_rates_second_half: dict[str, float] = field(default_factory=dict)  # strategy -> hit rate, second half
    gain_shares_second_half: dict[str, float] = field(default_factory=dict)
    offline_cpmemory_second_half: float = 0.0
    workers: int | None = None
    fleet: Any = None  # FleetSettings when the strategies ran on several replicas
    fleets: dict[str, Any] = field(default_factory=dict)  # strategy -> FleetReport

    def to_json(self) -> dict[str, Any]:
        """The ``"online"`` object of the replay JSON."""
        out: dict[str, Any] = {}
        for name, result in self.results.items():
            summary = result.summary()
            summary["gain_share"] = round(self.gain_shares.get(name, 0.0), 4)
            summary["hit_rate_second_half"] = round(self.hit_rates_second_half.get(name, 0.0), 6)
            summary["gain_share_second_half"] = round(self.gain_shares_second_half.get(name, 0.0), 4)
            if name in self.fleets:
                replicas = self.fleets[name].to_json()
                summary["replica_load_max_over_mean"] = replicas["load_max_over_mean"]
                summary["replicas"] = replicas
            out[name] = summary
        extra = {} if self.fleet is None else {"replicas": self.fleet.replicas, "router": self.fleet.router}
        return {"window": self.window, "workers": self.workers, **extra,
                "offline_cpmemory_hit_rate": round(self.offline_cpmemory, 6),
                "offline_cpmemory_hit_rate_second_half": round(self.offline_cpmemory_second_half, 6),
                "strategies": out}


def run_online_strategy(name: str, trace: Trace, prepared: Sequence[PreparedRequest], system_prompt: str,
                        simulator: Any, window: int, progress: Any = None,
                        workers: tuple[str, int, str] | None = None,
                        strategy: OnlineStrategy | None = None) -> StrategyResult:
    """Replay ``trace`` through one online strategy on ``simulator`` (fresh, mutated).

    Args:
        workers: (Redis URL, K, key prefix): the product runs as K facades on that Redis (None: one in memory).
        strategy: an already built strategy to run under ``name`` (``cpmemory_benchmarks.studies.online_ceiling``); default the
            registered one.
    """
    from cpmemory.core.invariants import check_no_loss

    if strategy is None:
        strategy = ONLINE_FACTORIES[name](_Context(trace, prepared, system_prompt, simulator, workers))
    result = StrategyResult(name)
    windows = Windows(trace, window)
    for waiting in windows:
        started = time.perf_counter()
        order = strategy.schedule(waiting)
        schedule_ms = (time.perf_counter() - started) * 1000.0 / len(waiting)
        for index in order:
            built = strategy.build(index)
            result.overhead_ms.append(strategy.decision_ms + schedule_ms)
            report = check_no_loss(list(prepared[index].blocks), built["messages"])
            result.violations.extend(f"request {index}: {v}" for v in report.violations)
            tokens = chat_tokens(built["messages"])
            cached = _serve(simulator, tokens, trace, index)
            windows.busy(len(tokens) - cached)
            result.record(built, len(tokens), cached, index)
            if progress is not None:
                progress(1)
    return result


def _serve(simulator: Any, tokens: list[int], trace: Trace, index: int) -> int:
    """Run one prompt on the cache, or on a fleet with the request's conversation (a session's later turn sticks)."""
    from cpmemory_benchmarks.replicas import ReplicaFleet

    if not isinstance(simulator, ReplicaFleet):
        return int(simulator.run(tokens))
    if not trace.multi_turn:
        return simulator.run(tokens)
    request = trace.requests[index]
    return simulator.run(tokens, key=str(request.session), sticky=request.turn > 1)


def gain_share(hit_rate: float, original: float, offline: float) -> float:
    """(hit - original) / (offline - original); 0 when the offline planner gains nothing."""
    span = offline - original
    return (hit_rate - original) / span if span > 1e-12 else 0.0


def run_online(trace: Trace, prepared: Sequence[PreparedRequest], system_prompt: str, capacity: int, mode: SimulatorMode,
               page_size: int | None, window: int, offline: dict[str, StrategyResult],
               strategies: Sequence[str] = ONLINE_STRATEGIES, progress: Any = None,
               workers: int | None = None, redis_url: str | None = None, fleet: Any = None) -> OnlineReport:
    """Run every online strategy on its own fresh cache; gain shares against ``offline['cpmemory']``.

    With ``fleet`` (``replicas.FleetSettings``) each strategy runs on N caches of ``capacity / N`` behind the router.

    With ``workers`` the product runs as that many facades on one Redis (``redis_url``, else a throw-away local
    ``redis-server`` for the run), under a fresh key prefix.
    """

    check_window(window)
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidInputError(f"--workers must be an integer >= 1, got {workers!r}")
        prefix = f"cpm-bench-{uuid.uuid4().hex[:12]}"
        with _redis(redis_url) as url:
            try:
                return _run_online(trace, prepared, system_prompt, capacity, mode, page_size, window, offline,
                                   strategies, progress, (url, workers, prefix), fleet)
            finally:
                _delete_prefix(url, prefix)
    return _run_online(trace, prepared, system_prompt, capacity, mode, page_size, window, offline, strategies,
                       progress, None, fleet)


def _delete_prefix(url: str, prefix: str) -> None:
    """Delete the run's keys (a fresh prefix per run) from the Redis it used."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(f"{prefix}:*", count=1000):
            client.delete(key)
    finally:
        client.close()


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from cpmemory.testing.local_redis import LocalRedisServer

    with LocalRedisServer() as server:
        server.start()
        yield server.url


def _run_online(trace: Trace, prepared: Sequence[PreparedRequest], system_prompt: str, capacity: int, mode: SimulatorMode,
                page_size: int | None, window: int, offline: dict[str, StrategyResult], strategies: Sequence[str],
                progress: Any, workers: tuple[str, int, str] | None, fleet: Any = None) -> OnlineReport:
    from cpmemory.bench.simulator import PrefixCacheSimulator
    from cpmemory_benchmarks.replicas import ReplicaFleet

    unknown = set(strategies) - set(ONLINE_STRATEGIES)
    if unknown:
        raise InvalidInputError(f"unknown online strategies {sorted(unknown)}; choose from {', '.join(ONLINE_STRATEGIES)}")
    results, fleets = {}, {}
    for name in strategies:
        simulator: Any
        if fleet is not None:
            simulator = ReplicaFleet(capacity, fleet, mode=mode, page_size=page_size)
        else:
            simulator = PrefixCacheSimulator(capacity, mode=mode, page_size=page_size)
        results[name] = run_online_strategy(name, trace, prepared, system_prompt, simulator, window, progress,
                                            workers if name == "cpmemory" else None)
        if fleet is not None:
            fleets[name] = simulator.report()
    offline_hit = offline["cpmemory"].hit_rate
    original = results["original"].hit_rate if "original" in results else offline["original"].hit_rate
    report = OnlineReport(window, results, offline_hit, original, workers=None if workers is None else workers[1],
                          fleet=fleet, fleets=fleets)
    report.gain_shares = {name: gain_share(r.hit_rate, original, offline_hit) for name, r in results.items()}
    second = second_half(len(trace.requests))
    report.offline_cpmemory_second_half = offline["cpmemory"].hit_rate_of(second)
    original_second = (results["original"] if "original" in results else offline["original"]).hit_rate_of(second)
    report.hit_rates_second_half = {name: r.hit_rate_of(second) for name, r in results.items()}
    report.gain_shares_second_half = {
        name: gain_share(hit, original_second, report.offline_cpmemory_second_half)
        for name, hit in report.hit_rates_second_half.items()}
    return report


def second_half(requests: int) -> range:
    """Trace positions of the second half of ``requests`` (the later ``requests - requests // 2``)."""
    return range(requests // 2, requests)
