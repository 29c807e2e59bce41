"""``cpmemory bench store``: session-store latency, throughput and round trips (in-memory, Redis, Redis Cluster).

Workload (:func:`cpmemory.bench.store_workload.make_workload`, seeded): ``conversations`` conversations of ``turns`` turns, 15 blocks per turn
(about 600 characters each) retrieved from a per-conversation topic (60 blocks of a shared corpus): 7 are kept from
the previous turn and the rest drawn from the topic, so about two thirds were already shown earlier in the
conversation and de-duplication has work to do. Each turn reserves with
the turn's (block id, content hash) pairs and commits the user message (the blocks not seen before, in full), the
answer and the blocks shown.

Phases, per backend:

* **sequential** (one conversation at a time, synchronous store): ``prepare_p50_ms`` / ``prepare_p99_ms`` are the
  store's ``reserve`` as the facade issues it when the caller passes the history (no transcript read);
  ``prepare_with_transcript_p50_ms`` is ``reserve`` also returning the stored transcript (facade with
  ``history=None``); ``commit_p50_ms`` / ``commit_p99_ms``.
* **facade on the shared state** (:mod:`cpmemory.bench.shared_state_bench`): on the Redis rows, ``--shared-state``
  requests (default 100,000) are first recorded in the tenant's shared decision state; then ``CpMemory.prepare``
  (reserve + the shared order + dedup + index + prompt, history given, no ``prompt_order``) and ``commit`` serve
  ``--facade-conversations`` conversations: ``facade_prepare_p50_ms`` / ``_p99_ms``, ``facade_commit_p50_ms``,
  ``facade_round_trips_per_request``, ``facade_added_p50_ms`` (prepare p50 minus the same phase on an in-memory
  store, run right after in the same process), ``tenant_memory_bytes`` (``MEMORY USAGE`` of the tenant's decision keys)
  with the bounds of that state. The memory row runs the same facade phase on the in-memory store (no fill).
* **baseline**: ``ping_p50_ms``, a redis-py PING on the same client timed right before each prepare (the floor of
  any round trip on this machine under the same load); ``prepare_over_ping`` is the ratio of the p50s.
* **round trips**, counted on the client socket (every ``send_packed_command`` of the connection class is one
  request/response exchange; a pipeline would count once), after one warm-up call that loads the scripts.
* **concurrent** (asyncio store, all conversations at once): ``turns_per_second`` and the latency percentiles
  under that load (``concurrent_prepare_p50_ms`` ...).
* ``seen_fraction``: share of the sequential phase's blocks that ``reserve`` reported as already shown; the same
  workload gives the same figure on every backend (a cross-check of the stores' semantics).

The ``redis`` row uses ``--redis-url`` (a local ``redis-server`` on a spare port is started if it does not answer);
the ``cluster`` row starts a 3-master cluster with :mod:`cpmemory.testing.local_redis` (skipped with a reason when
``redis-server`` is missing). Keys live under a prefix unique to the run and are deleted afterwards.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import typer

from cpmemory.bench.store_workload import BLOCK_CHARS, BLOCKS_PER_TURN, Block, Workload, make_workload
from cpmemory.bench.store_workload import quantile_ms as _ms
from cpmemory.core.blocks import label_for_hash
from cpmemory.types import ConversationKey, ReserveRequest, SeenBlock, TurnRecord

BACKENDS = ("memory", "redis", "cluster")


def _request(blocks: list[Block], include_transcript: bool) -> ReserveRequest:
    return ReserveRequest(tuple((b.id, b.digest) for b in blocks), include_transcript=include_transcript)


def _record(blocks: list[Block], seen: Any, turn: int) -> TurnRecord:
    shown = [b for b in blocks if b.digest not in seen]
    user = "\n\n".join(f"[{label_for_hash(b.digest)}]\n{b.text}" for b in shown) + f"\n\nQuestion {turn}?"
    messages = ({"role": "user", "content": user}, {"role": "assistant", "content": "An answer. " * 30})
    return TurnRecord(messages, tuple(SeenBlock(b.id, b.digest, label_for_hash(b.digest), 0) for b in shown))


class RoundTripCounter:
    """Counts request/response exchanges on the client sockets of one run."""

    def __init__(self) -> None:
        self.sends = 0

    def connection_class(self) -> type:
        """A redis-py Connection subclass that counts every ``send_packed_command`` into this counter."""
        import redis

        counter = self

        class CountingConnection(redis.Connection):
            def send_packed_command(self, command: Any, check_health: bool = True) -> None:
                counter.sends += 1
                super().send_packed_command(command, check_health)

        return CountingConnection


@dataclass
class Samples:
    """Latency samples (seconds) and call counts of one phase."""

    prepare: list[float] = field(default_factory=list)
    prepare_transcript: list[float] = field(default_factory=list)
    commit: list[float] = field(default_factory=list)
    ping: list[float] = field(default_factory=list)
    prepare_round_trips: int = 0
    commit_round_trips: int = 0
    blocks: int = 0
    blocks_seen: int = 0


def _timed(samples: list[float], call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    result = call(*args, **kwargs)
    samples.append(time.perf_counter() - start)
    return result


def run_sequential(store: Any, workload: Workload, counter: RoundTripCounter | None,
                   ping: Callable[[], Any] | None = None) -> Samples:
    """Every conversation, one at a time, on a synchronous store; counts round trips when ``counter`` is given.

    With ``ping`` (one no-op round trip), a ping is timed right before each prepare: a baseline under the same load.
    """
    samples = Samples()
    warm_key = ConversationKey(workload.tenant, "warm-up")
    for include in (False, True):  # loads the scripts (NOSCRIPT) outside the counted calls
        store.abort(warm_key, store.reserve(warm_key, _request(workload.turns[0][0], include)).reservation_id)
    store.commit(warm_key, store.reserve(warm_key, _request([], False)).reservation_id, TurnRecord((), ()))
    for number, conversation in enumerate(workload.turns):
        key = ConversationKey(workload.tenant, f"sequential-{number}")
        for turn, blocks in enumerate(conversation):
            peek = _timed(samples.prepare_transcript, store.reserve, key, _request(blocks, True))
            store.abort(key, peek.reservation_id)
            if ping is not None:
                _timed(samples.ping, ping)
            before = counter.sends if counter else 0
            reservation = _timed(samples.prepare, store.reserve, key, _request(blocks, False))
            middle = counter.sends if counter else 0
            record = _record(blocks, reservation.seen, turn)
            samples.blocks += len(blocks)
            samples.blocks_seen += sum(block.digest in reservation.seen for block in blocks)
            _timed(samples.commit, store.commit, key, reservation.reservation_id, record)
            if counter:
                samples.prepare_round_trips += middle - before
                samples.commit_round_trips += counter.sends - middle
        _progress(f"  sequential {number + 1}/{workload.conversations}", number + 1, workload.conversations)
    store.delete(warm_key)
    return samples


async def run_concurrent(store: Any, workload: Workload) -> tuple[Samples, float]:
    """All conversations at once on an asyncio store; returns the samples and the wall time in seconds."""
    samples = Samples()

    async def one(number: int, conversation: list[list[Block]]) -> None:
        key = ConversationKey(workload.tenant, f"concurrent-{number}")
        for turn, blocks in enumerate(conversation):
            start = time.perf_counter()
            reservation = await store.reserve(key, _request(blocks, False))
            middle = time.perf_counter()
            await asyncio.sleep(0)  # the LLM call would be here
            await store.commit(key, reservation.reservation_id, _record(blocks, reservation.seen, turn))
            samples.prepare.append(middle - start)
            samples.commit.append(time.perf_counter() - middle)

    warm_key = ConversationKey(workload.tenant, "warm-up-async")
    await store.abort(warm_key, (await store.reserve(warm_key, _request([], False))).reservation_id)
    start = time.perf_counter()
    await asyncio.gather(*(one(number, c) for number, c in enumerate(workload.turns)))
    return samples, time.perf_counter() - start


def _progress(message: str, done: int, total: int) -> None:
    if done == total or done % max(1, total // 4) == 0:
        print(message, file=sys.stderr, flush=True)


def summarize(name: str, workload: Workload, sequential: Samples, concurrent: Samples, wall_s: float,
              counted: bool) -> dict[str, Any]:
    """One result row (see the module docstring for what each figure means)."""
    calls = len(sequential.prepare)
    turns_total = sum(len(c) for c in workload.turns)
    return {
        "backend": name,
        "conversations": workload.conversations,
        "turns": len(workload.turns[0]) if workload.turns else 0,
        "round_trips_per_prepare": round(sequential.prepare_round_trips / calls, 3) if counted and calls else 0,
        "round_trips_per_commit": round(sequential.commit_round_trips / calls, 3) if counted and calls else 0,
        "prepare_p50_ms": _ms(sequential.prepare, 0.5),
        "prepare_p99_ms": _ms(sequential.prepare, 0.99),
        "prepare_with_transcript_p50_ms": _ms(sequential.prepare_transcript, 0.5),
        "commit_p50_ms": _ms(sequential.commit, 0.5),
        "commit_p99_ms": _ms(sequential.commit, 0.99),
        "turns_per_second": round(turns_total / wall_s, 1) if wall_s else None,
        "seen_fraction": round(sequential.blocks_seen / sequential.blocks, 4) if sequential.blocks else 0.0,
        "concurrent_prepare_p50_ms": _ms(concurrent.prepare, 0.5),
        "concurrent_prepare_p99_ms": _ms(concurrent.prepare, 0.99),
        "concurrent_commit_p50_ms": _ms(concurrent.commit, 0.5),
        "latency_mode": "sequential: one conversation at a time (sync store); "
        "turns_per_second and concurrent_*: all conversations at once (asyncio store)",
    }


@dataclass(frozen=True, slots=True)
class FacadePhase:
    """The facade phase's settings: conversations served through ``CpMemory`` and requests filled first."""

    conversations: int = 20
    shared_state: int = 100_000


def bench_memory(workload: Workload, facade: FacadePhase) -> dict[str, Any]:
    """The in-memory store row (no network: 0 round trips)."""
    from cpmemory.bench.shared_state_bench import run_shared_facade
    from cpmemory.stores.memory import AsyncInMemorySessionStore, InMemorySessionStore

    sequential = run_sequential(InMemorySessionStore(), workload, None)
    concurrent, wall = asyncio.run(run_concurrent(AsyncInMemorySessionStore(), workload))
    row = summarize("memory", workload, sequential, concurrent, wall, counted=True)
    shared = run_shared_facade(InMemorySessionStore(), workload, facade.conversations, lambda: 0, None)
    return {**row, **shared, "shared_state_requests": 0}


def bench_redis_url(name: str, url: str, cluster: bool, workload: Workload, facade: FacadePhase) -> dict[str, Any]:
    """A Redis (or Redis Cluster) row against ``url``; keys under a fresh prefix, deleted afterwards."""
    from cpmemory.bench.shared_state_bench import shared_state_row
    from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisStoreConfig

    config = RedisStoreConfig(prefix=f"cpmbench-{uuid.uuid4().hex[:10]}", socket_timeout_s=5.0, connect_timeout_s=2.0)
    counter = RoundTripCounter()
    store = _sync_store(url, config, cluster, counter)
    try:
        sequential = run_sequential(store, workload, counter, _ping(store.client, cluster))
        shared = shared_state_row(store, workload, facade.shared_state, facade.conversations,
                                  lambda: counter.sends, _ping(store.client, cluster), cluster)

        async def concurrent_phase() -> tuple[Samples, float]:
            async_store = AsyncRedisSessionStore.from_url(url, config, cluster=cluster)
            try:
                return await run_concurrent(async_store, workload)
            finally:
                await async_store.close()

        concurrent, wall = asyncio.run(concurrent_phase())
    finally:
        _delete_prefix(store, config.prefix, cluster)
        store.close()
    row = summarize(name, workload, sequential, concurrent, wall, counted=True)
    ping_p50_ms = _ms(sequential.ping, 0.5)
    return {**row, "ping_p50_ms": ping_p50_ms, "prepare_over_ping": round(row["prepare_p50_ms"] / ping_p50_ms, 2),
            **shared}


def _ping(client: Any, cluster: bool) -> Callable[[], Any]:
    """A no-op round trip on the same client (the baseline): PING, on the node of the benchmark keys for a cluster."""
    if cluster:
        return lambda: client.ping(target_nodes=client.get_random_node())
    return client.ping


def _sync_store(url: str, config: Any, cluster: bool, counter: RoundTripCounter) -> Any:
    import redis
    from redis.cluster import RedisCluster

    from cpmemory.stores.redis_store import RedisSessionStore

    kwargs = {**config.client_kwargs(), "connection_class": counter.connection_class()}
    client = RedisCluster.from_url(url, **kwargs) if cluster else redis.Redis.from_url(url, **kwargs)
    return RedisSessionStore(client, config)


def _delete_prefix(store: Any, prefix: str, cluster: bool) -> None:
    client = store.client
    scan = client.scan_iter(match=f"{prefix}:*", count=1000, **({"target_nodes": "primaries"} if cluster else {}))
    for key in list(scan):
        client.delete(key)


@contextmanager
def _redis_target(url: str) -> Iterator[tuple[str, str]]:
    """Yield (url, note): ``url`` if it answers, else a throw-away local redis-server."""
    import redis

    from cpmemory.testing.local_redis import LocalRedisServer, redis_binaries_available

    try:
        redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping()
        yield url, f"redis at {url}"
        return
    except redis.RedisError:
        if not redis_binaries_available():
            raise
    with LocalRedisServer() as server:
        yield server.url, f"{url} did not answer: used a local redis-server on port {server.port}"


def run_backend(name: str, workload: Workload, redis_url: str, facade: FacadePhase) -> dict[str, Any]:
    """Run one backend; a backend that cannot run gives a row with ``skipped`` and the reason."""
    from cpmemory.testing.local_redis import LocalRedisCluster, redis_binaries_available

    try:
        if name == "memory":
            return bench_memory(workload, facade)
        if name == "redis":
            with _redis_target(redis_url) as (url, note):
                return {**bench_redis_url("redis", url, False, workload, facade), "target": note}
        if not redis_binaries_available():
            return {"backend": name, "skipped": "redis-server / redis-cli not on PATH"}
        with ExitStack() as stack:
            local_cluster = stack.enter_context(LocalRedisCluster(masters=3))
            row = bench_redis_url("cluster", local_cluster.url, True, workload, facade)
            return {**row, "target": "local 3-master Redis Cluster (redis-server on spare ports)"}
    except ImportError as error:
        return {"backend": name, "skipped": f"missing dependency: {error}"}


_TABLE_COLUMNS = {
    "backend": "backend", "round_trips_per_prepare": "rt/prepare", "round_trips_per_commit": "rt/commit",
    "ping_p50_ms": "ping p50", "prepare_p50_ms": "prepare p50", "prepare_p99_ms": "prepare p99",
    "prepare_with_transcript_p50_ms": "prep+transcript p50", "commit_p50_ms": "commit p50",
    "turns_per_second": "turns/s (concurrent)", "concurrent_prepare_p50_ms": "concurrent prepare p50",
    "shared_state_requests": "shared state (requests)", "facade_prepare_p50_ms": "facade prepare p50",
    "facade_prepare_p99_ms": "facade prepare p99", "facade_added_p50_ms": "facade added p50",
    "facade_first_turn_added_p50_ms": "added p50 (1st turns)", "facade_round_trips_per_request": "rt/request (facade)",
    "tenant_memory_bytes": "tenant memory (bytes)",
}


def _table(results: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Session store: latency in ms, sequential; turns/s with all conversations concurrent")
    for header in _TABLE_COLUMNS.values():
        table.add_column(header)
    for row in results.values():
        if "skipped" in row:
            table.add_row(row["backend"], f"skipped: {row['skipped']}", *[""] * (len(_TABLE_COLUMNS) - 2))
        else:
            table.add_row(*(str(row.get(column, "-")) for column in _TABLE_COLUMNS))
    Console(width=200).print(table)


def command(
    backend: str = typer.Option("all", "--backend", help="memory, redis, cluster or all."),
    conversations: int = typer.Option(100, "--conversations", min=1, help="Concurrent conversations."),
    turns: int = typer.Option(10, "--turns", min=1, help="Turns per conversation."),
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", "--redis-url", help="Redis for the redis row."),
    facade_conversations: int = typer.Option(20, "--facade-conversations", min=1,
                                             help="Conversations also run through CpMemory.prepare + commit."),
    shared_state: int = typer.Option(100_000, "--shared-state", min=0,
                                     help="Requests recorded in the tenant's shared decision state before the "
                                          "facade phase (Redis rows)."),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Measure the session stores: prepare/commit latency, round trips, and throughput with concurrent turns."""
    names = BACKENDS if backend == "all" else (backend,)
    if any(name not in BACKENDS for name in names):
        raise typer.BadParameter(f"--backend must be one of {', '.join(BACKENDS)} or all")
    workload = make_workload(conversations, turns, seed)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        print(f"bench store: {name} ...", file=sys.stderr, flush=True)
        results[name] = run_backend(name, workload, redis_url, FacadePhase(facade_conversations, shared_state))
    summary = {"results": results, "workload": {"conversations": conversations, "turns": turns,
                                                "blocks_per_turn": BLOCKS_PER_TURN, "block_chars": BLOCK_CHARS,
                                                "seed": seed, "facade_conversations": facade_conversations,
                                                "shared_state_requests": shared_state}}
    if json_output:
        print(json.dumps(summary))
    else:
        _table(results)
