"""The facade on Redis with a filled shared decision state: ``cpmemory bench store``'s ``facade_*`` figures.

What it measures, per Redis backend (standalone or cluster):

1. **fill**: ``shared_state_requests`` (``--shared-state``, default 100,000) requests are ordered and recorded in one
   tenant's shared decision state (ordered, then recorded, as ``order_blocks`` does), pipelined 200 at a
   time. Each fill request is 15 blocks of one conversation topic of the workload's corpus (its first turns), so
   the trie is the one the online orderer builds from such traffic. A rich progress bar shows it (stderr).
2. **facade**: ``CpMemory(store=RedisSessionStore(...))``, on the same tenant, serves the workload's first
   ``facade_conversations`` conversations turn by turn as the integrations call it: ``prepare`` (caller-given
   history, no ``prompt_order``: the shared state orders every request) then ``commit``. ``facade_prepare_p50_ms`` /
   ``_p99_ms`` / ``facade_commit_p50_ms`` are wall times of those calls (sequential, one at a time);
   ``facade_round_trips_per_request`` counts the socket exchanges of a prepare plus its commit;
   ``facade_ping_p50_ms`` is a PING timed before each prepare (the round-trip floor under the same load).
   ``facade_first_turn_prepare_p50_ms``: the conversations' first turns alone (the only ones that walk the shared
   trie: a later turn's prompt opens with its own history, ``ReserveRequest.match_prefix``).
   Then the same conversations run on an in-memory store in the same process, right after
   (``facade_memory_prepare_p50_ms``, ``facade_memory_first_turn_prepare_p50_ms``), and ``facade_added_p50_ms`` /
   ``facade_first_turn_added_p50_ms`` are what Redis adds to ``CpMemory.prepare`` under the same load
   (``facade_prepare_over_memory``: the ratio of the p50s).
3. **memory**: ``tenant_memory_bytes`` is Redis ``MEMORY USAGE`` (exact, ``SAMPLES 0``) of the tenant's decision keys
   after the run, with the bounds that cap it (``decision_max_requests`` recorded orders, ``decision_max_blocks``
   counted blocks, the TTL) and ``tenant_memory_bytes_per_request``.
"""
from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from typing import Any

from cpmemory.bench.store_workload import BLOCKS_PER_TURN, Workload, quantile_ms

FILL_BATCH = 200


def _tenant_node(store: Any, tenant: str, cluster: bool) -> Any:
    """A plain client on the node holding the tenant's decision keys (one slot): a cluster pipeline refuses
    EVALSHA, a node's own pipeline does not."""
    if not cluster:
        return store.client
    import redis

    node = store.client.get_node_from_key(store.key_scheme.decision_keys(tenant)[0])
    return redis.Redis(host=node.host, port=node.port, socket_timeout=30.0)


def fill_shared_state(store: Any, workload: Workload, requests: int, cluster: bool = False, seed: int = 0) -> float:
    """Record ``requests`` orders in the workload tenant's shared decision state; returns the seconds it took.

    Per batch of ``FILL_BATCH`` requests, two pipelines: the ``order`` calls (observe + match), then the ``record``
    calls of the orders decided (so a batch's requests do not see each other's records, as with concurrent
    workers).
    """
    from cpmemory.bench.report import progress_bar

    rng = random.Random(seed)
    topics = [sorted({block for turn in conversation for block in turn}, key=lambda block: block.id)
              for conversation in workload.turns]
    codec = store._decisions
    store.decide_order(workload.tenant, ["warm-up"], [1.0], "")  # loads the script (on the tenant's node)
    sha = store._scripts["decide"].sha
    client = _tenant_node(store, workload.tenant, cluster)
    started = time.perf_counter()
    with progress_bar(requests, f"fill the shared state ({requests:,} requests)") as advance:
        for start in range(0, requests, FILL_BATCH):
            pipe = client.pipeline(transaction=False)
            count = min(FILL_BATCH, requests - start)
            orders = []
            for _ in range(count):
                blocks = rng.sample(topics[rng.randrange(len(topics))], BLOCKS_PER_TURN)
                order = codec.order_call(workload.tenant, [block.digest for block in blocks],
                                         [float(len(block.text) + 1) for block in blocks])
                orders.append(order)
                pipe.evalsha(sha, len(order.call.keys), *order.call.keys, *order.call.args)
            replies = pipe.execute()
            pipe = client.pipeline(transaction=False)
            for number, (order, reply) in enumerate(zip(orders, replies), start):
                call = codec.record_call(workload.tenant, order.decided(reply), f"fill-{number}")
                pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)
            pipe.execute()
            advance(count)
    return time.perf_counter() - started


def run_shared_facade(store: Any, workload: Workload, conversations: int, sends: Callable[[], int],
                      ping: Callable[[], Any] | None) -> dict[str, Any]:
    """``CpMemory.prepare`` + ``commit`` on ``store`` for the first ``conversations`` (history given, no
    prompt_order); ``sends()`` reads the socket exchange counter; ``ping`` (None: no server) is timed before each
    prepare. Returns the ``facade_*`` figures."""
    from cpmemory.facade import CpMemory

    memory = CpMemory(store=store)
    prepares: list[float] = []
    first_turns: list[float] = []
    commits: list[float] = []
    pings: list[float] = []
    round_trips = 0
    memory.commit(memory.prepare("warm-up", "q", [{"id": "w", "text": "warm"}], history=[],
                                 tenant=workload.tenant), "a")
    for number, conversation in enumerate(workload.turns[:conversations]):
        history: list[dict[str, str]] = []
        for blocks in conversation:
            payload = [{"id": block.id, "text": block.text} for block in blocks]
            if ping is not None:
                started = time.perf_counter()
                ping()
                pings.append(time.perf_counter() - started)
            before = sends()
            started = time.perf_counter()
            prepared = memory.prepare(f"shared-{number}", "What next?", payload, history=list(history),
                                      tenant=workload.tenant)
            middle = time.perf_counter()
            memory.commit(prepared, "An answer.")
            commits.append(time.perf_counter() - middle)
            prepares.append(middle - started)
            if not history:
                first_turns.append(middle - started)
            round_trips += sends() - before
            history.extend([prepared.messages[-1], {"role": "assistant", "content": "An answer."}])
        if (number + 1) % max(1, conversations // 4) == 0:
            print(f"  facade on the shared state {number + 1}/{conversations}", file=sys.stderr, flush=True)
    requests = len(prepares)
    ping_p50 = quantile_ms(pings, 0.5) if pings else None
    prepare_p50 = quantile_ms(prepares, 0.5)
    return {
        "facade_prepare_p50_ms": prepare_p50,
        "facade_prepare_p99_ms": quantile_ms(prepares, 0.99),
        "facade_first_turn_prepare_p50_ms": quantile_ms(first_turns, 0.5),
        "facade_commit_p50_ms": quantile_ms(commits, 0.5),
        "facade_requests": requests,
        "facade_round_trips_per_request": round(round_trips / requests, 3) if requests else 0,
        "facade_ping_p50_ms": ping_p50,
        "facade_prepare_over_ping": round(prepare_p50 / ping_p50, 2) if ping_p50 else None,
        "facade_fallbacks": int(memory.counters.snapshot().get("fallbacks", 0)),
    }


def added_over_memory(row: dict[str, Any], workload: Workload, conversations: int) -> dict[str, Any]:
    """The same facade phase on an in-memory store, run now (same process, same load), and what the Redis store
    added to the ``row``'s prepare p50 over it."""
    from cpmemory.stores.memory import InMemorySessionStore

    memory = run_shared_facade(InMemorySessionStore(), workload, conversations, lambda: 0, None)
    return {
        "facade_memory_prepare_p50_ms": memory["facade_prepare_p50_ms"],
        "facade_memory_first_turn_prepare_p50_ms": memory["facade_first_turn_prepare_p50_ms"],
        "facade_added_p50_ms": round(row["facade_prepare_p50_ms"] - memory["facade_prepare_p50_ms"], 4),
        "facade_prepare_over_memory": round(row["facade_prepare_p50_ms"] / memory["facade_prepare_p50_ms"], 2),
        "facade_first_turn_added_p50_ms": round(row["facade_first_turn_prepare_p50_ms"]
                                                - memory["facade_first_turn_prepare_p50_ms"], 4),
    }


def tenant_memory(store: Any, tenant: str, cluster: bool) -> dict[str, Any]:
    """``MEMORY USAGE`` of the tenant's decision keys and the bounds of that state."""
    client = store.client
    keys = store.key_scheme.decision_keys(tenant)
    options = {"target_nodes": client.get_node_from_key(keys[0])} if cluster else {}
    total = 0
    for key in keys:
        usage = client.execute_command("MEMORY USAGE", key, "SAMPLES", 0, **options)
        total += int(usage or 0)
    limits = store._decisions.limits
    return {
        "tenant_memory_bytes": total,
        "decision_max_requests": limits.max_requests,
        "decision_max_blocks": limits.max_blocks,
        "decision_ttl_s": limits.ttl_ms / 1000,
    }


def shared_state_row(store: Any, workload: Workload, requests: int, conversations: int, sends: Callable[[], int],
                     ping: Callable[[], Any], cluster: bool) -> dict[str, Any]:
    """Fill, run the facade, measure the memory (see the module docstring)."""
    fill_s = fill_shared_state(store, workload, requests, cluster) if requests else 0.0
    row: dict[str, Any] = {"shared_state_requests": requests, "fill_seconds": round(fill_s, 1)}
    row.update(run_shared_facade(store, workload, conversations, sends, ping))
    row.update(added_over_memory(row, workload, conversations))
    row.update(tenant_memory(store, workload.tenant, cluster))
    recorded = max(1, min(requests, row["decision_max_requests"]))
    row["tenant_memory_bytes_per_request"] = round(row["tenant_memory_bytes"] / recorded, 1)
    return row
