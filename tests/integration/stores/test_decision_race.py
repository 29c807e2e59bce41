"""Workers racing on one tenant's shared decision state, as real processes: the state stays consistent.

Four processes (spawned interpreters, as uvicorn workers are) order, record, evict and forget (a small bound)
requests of one tenant at once, through ``decide_order`` / ``evict_decisions`` and through the facade's
prepare + commit pipelines. Afterwards every trie node's count is the number of recorded requests through it, no
field is orphaned, and the fifo names exactly the recorded requests (``check_decisions``); a corrupted count is
caught by the same check.
"""
from __future__ import annotations

import multiprocessing
import random
import uuid

import pytest

from cpmemory.errors import IndexIntegrityError
from cpmemory.stores.redis_store import RedisSessionStore, RedisStoreConfig
from tests.redis_env import redis_url

redis = pytest.importorskip("redis")
pytestmark = pytest.mark.redis

WORKERS = 4
REQUESTS = 120
BOUND = 60  # recorded requests kept: the bound forgets while the others record
TEXTS = {i: f"Document {i}: " + "word " * (3 + (5 * i) % 17) for i in range(24)}


def _store(prefix: str) -> RedisSessionStore:
    from cpmemory.stores.decisions import DecisionLimits

    store = RedisSessionStore.from_url(redis_url(), RedisStoreConfig(prefix=prefix, socket_timeout_s=5.0))
    store._decisions = type(store._decisions)(store._decisions.keys, DecisionLimits(max_requests=BOUND, fanout=3))
    return store


def _worker(prefix: str, number: int) -> None:
    from cpmemory.facade import CpMemory

    rng = random.Random(number)
    store = _store(prefix)
    memory = CpMemory(store=store)
    mine: list[str] = []
    for step in range(REQUESTS):
        ids = rng.sample(range(len(TEXTS)), rng.randint(2, 7))
        if step % 3 == 0:  # a conversation's first turn: ordered in reserve's pipeline, recorded in commit's
            turn = memory.prepare(f"w{number}-{step}", "q", [{"id": str(i), "text": TEXTS[i]} for i in ids])
            memory.commit(turn, "answer")
            continue
        request = f"w{number}-r{step}"
        store.decide_order("t", [f"k{i:02d}" for i in ids], [float(len(TEXTS[i])) for i in ids], request)
        mine.append(request)
        if step % 4 == 1:
            store.evict_decisions("t", [mine.pop(rng.randrange(len(mine)))])


@pytest.fixture
def prefix():  # type: ignore[no-untyped-def]
    name = f"cpmtest-race-{uuid.uuid4().hex[:10]}"
    yield name
    client = redis.Redis.from_url(redis_url())
    for key in client.scan_iter(f"{name}:*"):
        client.delete(key)
    client.close()


def test_four_processes_racing_on_one_tenant_leave_a_consistent_state(prefix: str) -> None:
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_worker, args=(prefix, number)) for number in range(WORKERS)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [process.exitcode for process in processes] == [0] * WORKERS

    store = _store(prefix)
    store.check_decisions("t")
    store.check_decisions("default")  # the facades' tenant
    client = redis.Redis.from_url(redis_url())
    trie, _, _, paths, _ = store.key_scheme.decision_keys("t")
    assert client.hlen(paths) == BOUND  # full: the bound held while four workers recorded
    field = next(name for name in client.hkeys(trie) if len(name) == 8)
    value = client.hget(trie, field)
    client.hset(trie, field, value[:6] + (int.from_bytes(value[6:10], "big") + 1).to_bytes(4, "big") + value[10:])
    with pytest.raises(IndexIntegrityError):
        store.check_decisions("t")
    client.close()
