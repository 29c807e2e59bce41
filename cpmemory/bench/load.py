"""``cpmemory bench load``: concurrent conversations through the proxy; overhead, errors, lost blocks, throughput.

``overhead_*``: the proxy's own time per request (outside the engine call and admission's waits); ``wait_*``: the
time admission held a request by design (the hold queue, cache-fit admission), reported apart.

The proxy runs in this process (uvicorn on a free loopback port) in front of in-process mock engines (default) or
real engines given by URL (loopback only). Every conversation runs its turns one after another, all conversations
at once. Each turn retrieves blocks from a shared pool, overlapping the previous turn's blocks, so de-duplication
and reordering are exercised. What the proxy sends to the engine is recorded by request id, and every request is
checked with ``check_no_loss`` against the blocks the caller passed (``lost_blocks`` counts violations).

The run is bounded: ``--conversations`` x ``--turns`` requests, and ``--time-limit`` seconds.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import typer

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
WORDS = ("river", "policy", "engine", "harbor", "ledger", "garden", "signal", "cobalt", "meadow", "quartz",
         "violet", "summit", "canvas", "anchor", "orbit", "pepper", "willow", "falcon", "marble", "lantern")


@dataclass(slots=True)
class LoadStats:
    """What the generator observed (mutated while the run goes)."""

    requests: int = 0
    errors: int = 0
    lost_blocks: int = 0
    unchecked: int = 0
    overhead_ms: list[float] = field(default_factory=list)
    wait_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    tokens_deduplicated: int = 0
    replica_changes: int = 0
    error_samples: list[str] = field(default_factory=list)
    to_check: list[tuple[list[dict[str, str]], list[Mapping[str, str]]]] = field(default_factory=list)


class RecordingTransport:
    """Wraps a ChatTransport and keeps, per request id, the messages sent to the engine (bounded by the run)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: dict[str, list[Mapping[str, str]]] = {}

    @property
    def client(self) -> Any:
        """The inner transport's HTTP client (the proxy's engine client for ``/v1/models`` and ``/tokenize`` uses
        it: without it a proxy on this transport would run without the prompt budget and the engine's tokenizer)."""
        return getattr(self.inner, "client", None)

    async def complete(self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str],
                       timeout_s: float) -> dict[str, Any]:
        self.sent[str(payload.get("request_id"))] = list(payload.get("messages") or [])
        return await self.inner.complete(base_url, payload, headers, timeout_s)

    async def open_stream(self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str],
                          timeout_s: float) -> Any:
        self.sent[str(payload.get("request_id"))] = list(payload.get("messages") or [])
        return await self.inner.open_stream(base_url, payload, headers, timeout_s)

    async def is_healthy(self, base_url: str) -> bool:
        return await self.inner.is_healthy(base_url)

    async def aclose(self) -> None:
        await self.inner.aclose()


def make_pool(size: int, block_chars: int, seed: int) -> list[dict[str, str]]:
    """A deterministic pool of ``size`` blocks of about ``block_chars`` characters."""
    rng = random.Random(seed)
    pool = []
    for number in range(size):
        words: list[str] = []
        while sum(len(word) + 1 for word in words) < block_chars:
            words.append(rng.choice(WORDS))
        pool.append({"id": f"doc-{number}", "text": f"Document {number}: " + " ".join(words) + "."})
    return pool


def turn_blocks(rng: random.Random, pool: list[dict[str, str]], previous: list[dict[str, str]],
                count: int) -> list[dict[str, str]]:
    """About 40% of the previous turn's blocks (as in MT-RAG), the rest fresh from the pool, shuffled."""
    keep = rng.sample(previous, min(len(previous), round(count * 0.4))) if previous else []
    chosen = {block["id"] for block in keep}
    fresh = [block for block in rng.sample(pool, min(len(pool), count * 2)) if block["id"] not in chosen]
    blocks = keep + fresh[: count - len(keep)]
    rng.shuffle(blocks)
    return blocks


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def _check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK_HOSTS and f"[{host}]" not in LOOPBACK_HOSTS:
        raise typer.BadParameter(f"the load generator only targets loopback engines, not {host!r}")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def build_proxy(engine: str, replicas: int) -> tuple[Any, RecordingTransport]:
    """The proxy app over mock engines (``engine == "mock"``) or the given loopback URLs (comma separated)."""
    from cpmemory.routing.transport import HttpxChatTransport
    from cpmemory.server.app import ServerConfig, create_app

    if engine == "mock":
        from cpmemory.testing.fleet import MockFleet

        fleet = MockFleet([f"http://mock-{i}" for i in range(replicas)], block_size=128, capacity_blocks=1 << 14)
        urls = fleet.urls
        inner = fleet.chat_transport()
    else:
        urls = [url.strip() for url in engine.split(",") if url.strip()]
        for url in urls:
            _check_loopback(url)
        inner = HttpxChatTransport()
    recording = RecordingTransport(inner)
    return create_app(ServerConfig(engines=urls), transport=recording), recording


async def _conversation(client: Any, number: int, turns: int, pool: list[dict[str, str]], count: int,
                        stats: LoadStats, recording: RecordingTransport, seed: int) -> None:
    rng = random.Random(seed * 100_003 + number)
    previous: list[dict[str, str]] = []
    replica = None
    for turn in range(turns):
        blocks = turn_blocks(rng, pool, previous, count)
        previous = blocks
        body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": f"Question {turn}?"}],
                "cpmemory": {"conversation_id": f"load-{seed}-{number}", "blocks": blocks}}
        started = time.perf_counter()
        stats.requests += 1
        try:
            response = await client.post("/v1/chat/completions", json=body)
        except Exception as error:  # noqa: BLE001 - any failure is counted as an error of this request
            _error(stats, f"{type(error).__name__}: {error}")
            continue
        stats.latency_ms.append((time.perf_counter() - started) * 1000)
        if response.status_code != 200:
            _error(stats, f"HTTP {response.status_code}: {response.text[:200]}")
            continue
        info = response.json().get("cpmemory") or {}
        replica = _account(stats, info, replica)
        sent = recording.sent.pop(str(info.get("request_id")), None)
        if sent is None:
            stats.unchecked += 1
            continue
        stats.to_check.append((blocks, sent))  # checked after the run: keeps the event loop free for the proxy


def _error(stats: LoadStats, message: str) -> None:
    stats.errors += 1
    if len(stats.error_samples) < 5:
        stats.error_samples.append(message)


def _account(stats: LoadStats, info: Mapping[str, Any], replica: Any) -> Any:
    stats.overhead_ms.append(float(info.get("overhead_ms", 0.0)))
    stats.wait_ms.append(float(info.get("wait_ms", 0.0)))
    stats.cached_tokens += int(info.get("cached_tokens", 0))
    stats.prompt_tokens += int(info.get("prompt_tokens", 0))
    stats.tokens_deduplicated += int(info.get("tokens_deduplicated", 0))
    if replica is not None and info.get("replica") != replica:
        stats.replica_changes += 1
    return info.get("replica")


async def _progress(stats: LoadStats, total: int, quiet: bool) -> None:
    while True:
        await asyncio.sleep(2.0)
        if not quiet:
            print(f"  {stats.requests}/{total} requests, {stats.errors} errors", file=sys.stderr, flush=True)


async def run_load(conversations: int, turns: int, engine: str, replicas: int, blocks: int, block_chars: int,
                   time_limit_s: float, seed: int, quiet: bool = True) -> dict[str, Any]:
    """Run the load test and return its figures (see the module docstring)."""
    import httpx
    import uvicorn

    app, recording = build_proxy(engine, replicas)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on",
                                           timeout_keep_alive=300))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.02)
    stats = LoadStats()
    pool = make_pool(max(blocks * 6, 48), block_chars, seed)
    limits = httpx.Limits(max_connections=conversations, max_keepalive_connections=conversations)
    progress = asyncio.create_task(_progress(stats, conversations * turns, quiet))
    started = time.perf_counter()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=120) as client:
            jobs = [_conversation(client, n, turns, pool, blocks, stats, recording, seed) for n in range(conversations)]
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=time_limit_s)
    except asyncio.TimeoutError:
        _error(stats, f"time limit of {time_limit_s}s reached")
    finally:
        wall = time.perf_counter() - started
        progress.cancel()
        server.should_exit = True
        await serving
        await recording.aclose()
    from cpmemory.core.invariants import check_no_loss

    for passed, sent in stats.to_check:
        stats.lost_blocks += len(check_no_loss(passed, sent).violations)
    stats.to_check.clear()
    return _figures(stats, conversations, turns, wall)


def _figures(stats: LoadStats, conversations: int, turns: int, wall: float) -> dict[str, Any]:
    return {
        "conversations": conversations, "turns": turns, "requests": stats.requests, "errors": stats.errors,
        "lost_blocks": stats.lost_blocks, "unchecked_requests": stats.unchecked,
        "overhead_p50_ms": round(percentile(stats.overhead_ms, 0.5), 3),
        "overhead_p99_ms": round(percentile(stats.overhead_ms, 0.99), 3),
        "overhead_mean_ms": round(statistics.fmean(stats.overhead_ms), 3) if stats.overhead_ms else 0.0,
        "wait_p50_ms": round(percentile(stats.wait_ms, 0.5), 3),
        "wait_p99_ms": round(percentile(stats.wait_ms, 0.99), 3),
        "wait_mean_ms": round(statistics.fmean(stats.wait_ms), 3) if stats.wait_ms else 0.0,
        "latency_p50_ms": round(percentile(stats.latency_ms, 0.5), 3),
        "latency_p99_ms": round(percentile(stats.latency_ms, 0.99), 3),
        "throughput_rps": round(stats.requests / wall, 2) if wall > 0 else 0.0,
        "wall_seconds": round(wall, 3), "cached_tokens": stats.cached_tokens, "prompt_tokens": stats.prompt_tokens,
        "tokens_deduplicated": stats.tokens_deduplicated, "replica_changes": stats.replica_changes,
        "error_samples": stats.error_samples,
    }


def command(
    conversations: int = typer.Option(200, "--conversations", min=1, max=5000, help="Concurrent conversations."),
    turns: int = typer.Option(3, "--turns", min=1, max=50, help="Turns per conversation."),
    engine: str = typer.Option("mock", "--engine", help="'mock' or loopback engine URL(s), comma separated."),
    replicas: int = typer.Option(2, "--replicas", min=1, max=16, help="Mock engine replicas."),
    blocks: int = typer.Option(8, "--blocks", min=1, max=200, help="Blocks per turn."),
    block_chars: int = typer.Option(400, "--block-chars", min=10, max=100_000, help="Characters per block."),
    time_limit: float = typer.Option(600.0, "--time-limit", min=1.0, help="Stop after this many seconds."),
    seed: int = typer.Option(0, "--seed", help="Random seed of the workload."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run concurrent conversations through the proxy and print overhead, errors, lost blocks and throughput."""
    if not json_output:
        print(f"cpmemory bench load: {conversations} conversations x {turns} turns, engine={engine}",
              file=sys.stderr)
    figures = asyncio.run(run_load(conversations, turns, engine, replicas, blocks, block_chars, time_limit, seed,
                                   quiet=json_output))
    if json_output:
        print(json.dumps(figures))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="cpmemory bench load")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in figures.items():
        if name != "error_samples":
            table.add_row(name, str(value))
    Console().print(table)
    for sample in figures["error_samples"]:
        print(f"error: {sample}", file=sys.stderr)
