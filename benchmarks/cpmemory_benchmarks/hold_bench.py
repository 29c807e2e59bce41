"""``cpmemory bench hold``: the proxy's hold-and-release queue on and off, same workload, same run.

Concurrent clients (a closed loop: each sends its next request when the last one answered) replay a workload's
independent requests through the real proxy app (in process, over httpx's ASGI seam) in front of mock engine
replicas (:class:`~cpmemory.testing.fleet.MockFleet`: LRU prefix caches, one token per byte). Each replica runs at
most ``--slots`` requests at once for ``--service-ms`` each and queues the rest first come first served, as vLLM
does past ``--max-num-seqs``; a request's cached prefix is matched when it is scheduled. Runs: the queue off, then
``--max-in-flight = --slots`` with each ``--hold-ms``; each run gets fresh engines and a fresh facade.

Per run: the engines' cached share of the prompt tokens (usage), errors, blocks lost (``check_no_loss`` on what
reached the engine), the queue's counters (held requests, releases by reason and order, mean window) and latency.

Example::

    cpmemory bench hold --workload multihop --requests 500 --clients 32 --slots 8 --hold-ms 5 --hold-ms 50 --json
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import typer

from cpmemory.bench.load import percentile
from cpmemory.bench.trace import TraceRequest
from cpmemory.facade import AsyncCpMemory

MOCK_BLOCK_SIZE = 16
"""Tokens per block of the mock replicas (a token is a byte there)."""
MOCK_CHARS_PER_TOKEN = 4
"""The proxy's unit: characters per token (``ServerConfig.memory.chars_per_token``). The proxy is told each mock
replica's cache in it (``replica_cache_tokens``), as it reads a vLLM replica's from ``/metrics``: the hold planner
plans a window that outgrows the caches as a batch, and the router's sent view is bounded by it. Cache-fit admission
is sized by it too, which does not matter here: every request is a lone question, sent at once."""

HOLD_WORKLOADS = ("multihop", "synthetic", "locomo", "locomo_sessions", "synthetic300")


class PacedTransport:
    """A ChatTransport over the fleet's whose replicas run at most ``slots`` calls at once (FIFO queue beyond)."""

    def __init__(self, inner: Any, slots: int, service_s: float) -> None:
        self.inner = inner
        self.client = inner.client  # the proxy's budget probe uses it, as with the real transport
        self.slots = slots
        self.service_s = service_s
        self._gates: dict[str, asyncio.Semaphore] = {}
        self.sent: dict[str, list[Mapping[str, Any]]] = {}  # request id -> messages that reached the engine

    async def complete(self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str],
                       timeout_s: float) -> dict[str, Any]:
        gate = self._gates.setdefault(base_url, asyncio.Semaphore(self.slots))
        async with gate:  # scheduled: the mock matches the cached prefix now, then the request runs
            self.sent[str(payload.get("request_id"))] = list(payload.get("messages") or [])
            response: dict[str, Any] = await self.inner.complete(base_url, payload, headers, timeout_s)
            await asyncio.sleep(self.service_s)
        return response

    async def open_stream(self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str],
                          timeout_s: float) -> Any:
        raise NotImplementedError("bench hold sends non-streaming requests")

    async def is_healthy(self, base_url: str) -> bool:
        return bool(await self.inner.is_healthy(base_url))

    async def aclose(self) -> None:
        await self.inner.aclose()


def _body(number: int, request: TraceRequest) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": request.query}],
            "cpmemory": {"conversation_id": f"q{number}",
                         "blocks": [{"id": block.id, "text": block.text} for block in request.blocks]}}


def capacity_blocks(requests: Sequence[TraceRequest], fraction: float, block_size: int) -> int:
    """``fraction`` of the distinct block text (one token per UTF-8 byte), in engine blocks (at least 64)."""
    distinct = {block.id: block.text for request in requests for block in request.blocks}
    tokens = sum(len(text.encode("utf-8")) for text in distinct.values())
    return max(64, int(fraction * tokens / block_size))


class FcfsMemory(AsyncCpMemory):
    """The facade without its window planner: the proxy's queue then releases first come first served."""

    release_order = None  # type: ignore[assignment]
    release_plan = None  # type: ignore[assignment]


def configurations(holds: Sequence[float], fcfs: bool) -> list[dict[str, Any]]:
    """The runs of one round: the queue off, on with each hold (planner order), and FCFS too when asked."""
    runs: list[dict[str, Any]] = [{"queue": "off", "hold_ms": None, "planner": False}]
    for hold in holds:
        runs.append({"queue": f"hold {hold:g} ms", "hold_ms": hold, "planner": True})
        if fcfs:
            runs.append({"queue": f"hold {hold:g} ms, fcfs", "hold_ms": hold, "planner": False})
    return runs


async def run_once(requests: Sequence[TraceRequest], settings: Mapping[str, Any], configuration: Mapping[str, Any]
                   ) -> dict[str, Any]:
    """One run: fresh engines, facade and proxy; the queue off (``hold_ms`` None) or on. Returns its figures."""
    import httpx

    from cpmemory.core.invariants import check_no_loss
    from cpmemory.server.app import ServerConfig, create_app
    from cpmemory.testing.fleet import MockFleet

    fleet = MockFleet(settings["replicas"], block_size=MOCK_BLOCK_SIZE, capacity_blocks=settings["capacity_blocks"])
    transport = PacedTransport(fleet.chat_transport(), settings["slots"], settings["service_ms"] / 1000.0)
    hold_ms = configuration["hold_ms"]
    extra: dict[str, Any] = {} if hold_ms is None else {"hold": {"policy": "window", "max_in_flight": settings["slots"],
                                                 "token_bound": False, "timeout_ms": hold_ms}}
    # the proxy knows each replica's cache, as it reads it from vLLM's /metrics: in its unit of 4 characters a
    # token (the mock counts a byte a token), for the router's sent view and the hold planner's model of the cache
    extra["replica_cache_tokens"] = int(settings["capacity_blocks"] * MOCK_BLOCK_SIZE / MOCK_CHARS_PER_TOKEN)
    app = create_app(ServerConfig.model_validate({"engines": fleet.urls, **extra}), memory=AsyncCpMemory() if configuration["planner"] else FcfsMemory(),
                     transport=transport)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=600)
    queue = iter(enumerate(requests))
    answers: list[tuple[int, dict[str, Any]]] = []
    latencies: list[float] = []
    errors = 0

    async def one_client() -> None:
        nonlocal errors
        for number, request in queue:
            started = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=_body(number, request))
            latencies.append((time.perf_counter() - started) * 1000.0)
            if response.status_code == 200:
                answers.append((number, response.json()))
            else:
                errors += 1

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one_client() for _ in range(settings["clients"])))
    finally:
        await client.aclose()
        await transport.aclose()
    seconds = time.perf_counter() - started
    cached = sum(int(body["cpmemory"]["cached_tokens"] or 0) for _, body in answers)
    prompt = sum(int(body["cpmemory"]["prompt_tokens"] or 0) for _, body in answers)
    lost = sum(1 for number, body in answers
               if not check_no_loss(_body(number, requests[number])["cpmemory"]["blocks"],
                                    transport.sent.get(body["cpmemory"]["request_id"], [])).ok)
    figures: dict[str, Any] = {
        **configuration, "requests": len(answers), "errors": errors, "lost": lost,
        "cached_tokens": cached, "prompt_tokens": prompt, "cached_share": round(cached / prompt, 4) if prompt else 0.0,
        "latency_mean_ms": round(statistics.fmean(latencies), 2) if latencies else 0.0,
        "latency_p99_ms": round(percentile(latencies, 0.99), 2), "seconds": round(seconds, 2),
    }
    registry = app.state.service.metrics.registry
    figures["route_reasons"] = _route_reasons(registry, settings["replicas"])
    figures.update(_hold_figures(registry) if hold_ms is not None else {})
    return figures


def _route_reasons(registry: Any, replicas: int) -> dict[str, int]:
    """How the router decided (cpmemory.routing.router.ROUTE_REASONS), over every replica."""
    from cpmemory.routing.router import ROUTE_REASONS

    return {reason: int(sum(registry.get_sample_value("cpmemory_route_decisions_total",
                                                      {"replica": str(replica), "reason": reason}) or 0
                            for replica in range(replicas))) for reason in ROUTE_REASONS}


def _hold_figures(registry: Any) -> dict[str, Any]:
    """The queue's counters from the proxy's own metrics."""
    def value(name: str, **labels: str) -> float:
        return float(registry.get_sample_value(name, labels) or 0.0)

    releases = {f"{reason}/{order}": int(value("cpmemory_hold_releases_total", reason=reason, order=order))
                for reason in ("slot", "timeout") for order in ("planner", "fcfs")}
    released = sum(value("cpmemory_hold_released_total", reason=reason) for reason in ("slot", "timeout"))
    windows = sum(releases.values())
    return {"held": int(value("cpmemory_hold_held_total")), "releases": releases,
            "mean_window": round(released / windows, 2) if windows else 0.0,
            "hold_mean_ms": round(1000 * value("cpmemory_hold_seconds_sum") / released, 2) if released else 0.0}


async def run_all(requests: Sequence[TraceRequest], settings: Mapping[str, Any],
                  runs_of_a_round: Sequence[Mapping[str, Any]], rounds: int, quiet: bool) -> list[dict[str, Any]]:
    """The queue off, then on with each hold, one after another (same requests, fresh state each); with several
    rounds, every other round runs them in reverse order (ABBA), against the machine's load drift."""
    runs = []
    for round_number in range(rounds):
        for configuration in runs_of_a_round if round_number % 2 == 0 else list(reversed(runs_of_a_round)):
            if not quiet:
                print(f"cpmemory bench hold: round {round_number + 1}/{rounds}, queue {configuration['queue']} ...",
                      file=sys.stderr)
            runs.append({"round": round_number, **await run_once(requests, settings, configuration)})
    return runs


def summarize(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration (queue off, each hold): the cached share of every round, its mean, and the totals."""
    by_queue: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        by_queue.setdefault(run["queue"], []).append(run)
    summary = []
    for queue, group in by_queue.items():
        shares = [run["cached_share"] for run in group]
        summary.append({
            "queue": queue, "hold_ms": group[0]["hold_ms"], "cached_share_mean": round(statistics.fmean(shares), 4), "cached_shares": shares,
            "errors": sum(run["errors"] for run in group), "lost": sum(run["lost"] for run in group),
            "held": sum(run.get("held", 0) for run in group),
            "mean_window": round(statistics.fmean(run.get("mean_window", 0.0) for run in group), 2),
            "latency_mean_ms": round(statistics.fmean(run["latency_mean_ms"] for run in group), 1),
        })
    return summary


def command(
    workload: str = typer.Option("multihop", "--workload", help=f"One of {', '.join(HOLD_WORKLOADS)}."),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Where the workloads' data lives."),
    requests: int = typer.Option(500, "--requests", min=1, help="How many of the workload's requests (in order)."),
    clients: int = typer.Option(32, "--clients", min=1, max=1000, help="Concurrent clients (closed loop)."),
    slots: int = typer.Option(8, "--slots", min=1, help="Requests a replica runs at once; the proxy's bound."),
    service_ms: float = typer.Option(20.0, "--service-ms", min=0.0, help="How long each request runs."),
    replicas: int = typer.Option(1, "--replicas", min=1, max=16, help="Mock engine replicas."),
    capacity: float = typer.Option(0.2, "--capacity", min=0.001, help="Cache per replica: share of the distinct "
                                   "block tokens."),
    hold_ms: list[float] | None = typer.Option(None, "--hold-ms", help="Hold of a run with the queue on (repeat; "
                                               "default 5)."),
    rounds: int = typer.Option(1, "--rounds", min=1, max=20, help="Repeat every configuration (ABBA order)."),
    fcfs: bool = typer.Option(False, "--fcfs", help="Also run each hold without the planner (first come first "
                              "served): what holding alone does."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run the same workload with the hold queue off and on; print the cached share of each run."""
    from cpmemory.bench.loaders import load_workload

    if workload not in HOLD_WORKLOADS:
        raise typer.BadParameter(f"--workload must be one of {', '.join(HOLD_WORKLOADS)} (independent requests)")
    holds = hold_ms or [5.0]
    if any(value <= 0 or value > 1000 for value in holds):
        raise typer.BadParameter("--hold-ms must be in (0, 1000]")
    trace = load_workload(workload, data_dir)
    chosen = list(trace.requests[:requests])
    settings = {"clients": clients, "slots": slots, "service_ms": service_ms, "replicas": replicas,
                "capacity_blocks": capacity_blocks(chosen, capacity, MOCK_BLOCK_SIZE)}
    runs = asyncio.run(run_all(chosen, settings, configurations(holds, fcfs), rounds, quiet=json_output))
    report = {"workload": workload, "requests": len(chosen), **settings, "capacity": capacity, "rounds": rounds,
              "summary": summarize(runs), "runs": runs}
    if json_output:
        print(json.dumps(report))
        return
    _print_table(report)


def _print_table(report: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cpmemory bench hold: {report['workload']}, {report['requests']} requests, "
                        f"{report['clients']} clients, {report['slots']} slots x {report['service_ms']:g} ms, "
                        f"{report['rounds']} round(s)")
    for column in ("queue", "cached share (mean)", "per round", "errors", "lost", "held", "mean window",
                   "latency mean ms"):
        table.add_column(column, justify="right")
    for row in report["summary"]:
        table.add_row(row["queue"], f"{100 * row['cached_share_mean']:.2f}%",
                      " ".join(f"{100 * share:.2f}" for share in row["cached_shares"]), str(row["errors"]),
                      str(row["lost"]), str(row["held"]) if row["hold_ms"] is not None else "-",
                      str(row["mean_window"]) if row["hold_ms"] is not None else "-", f"{row['latency_mean_ms']:.1f}")
    Console().print(table)
