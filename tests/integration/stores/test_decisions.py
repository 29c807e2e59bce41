"""The shared decision state in Redis: K facades decide as one, a restart resumes, the Lua orderer is the Python one,
2 round trips per request, evictions and bounds, tenants apart."""
from __future__ import annotations

import asyncio
import random
import threading
import uuid

import pytest

from cpmemory.core import online
from cpmemory.core.online import OnlineOrderer
from cpmemory.facade import AsyncCpMemory, CpMemory
from cpmemory.stores.decisions import DecisionLimits
from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisSessionStore, RedisStoreConfig
from tests.redis_env import redis_url

redis = pytest.importorskip("redis")
pytestmark = pytest.mark.redis

TEXTS = {i: f"Document {i}: " + "word " * (4 + (7 * i) % 23) for i in range(40)}


def blocks(*ids):
    return [{"id": str(i), "text": TEXTS[i]} for i in ids]


@pytest.fixture
def prefix():
    name = f"cpmtest-dec-{uuid.uuid4().hex[:10]}"
    yield name
    client = redis.Redis.from_url(redis_url())
    for key in client.scan_iter(f"{name}:*"):
        client.delete(key)
    client.close()


def facade(prefix: str) -> CpMemory:
    return CpMemory(store=RedisSessionStore.from_url(redis_url(), RedisStoreConfig(prefix=prefix)))


def test_the_limits_match_the_python_orderer():
    assert DecisionLimits().match_budget == online.MATCH_BUDGET
    assert DecisionLimits().recency_scale == online.RECENCY_SCALE
    assert DecisionLimits().posting_length == online.POSTING_LENGTH


def test_two_facades_on_one_redis_decide_as_one_and_a_new_one_resumes(prefix):
    first, second = facade(prefix), facade(prefix)
    turn = first.prepare("a", "q", blocks(3, 1, 2))
    first.commit(turn, "x")
    other = second.prepare("b", "q", blocks(7, 2, 1, 3))
    assert other.prompt_order[:3] == turn.prompt_order  # decided from the first facade's order
    second.commit(other, "x")
    restarted = facade(prefix)
    again = restarted.prepare("c", "q", blocks(1, 9, 3, 7, 2))
    assert again.prompt_order[:4] == other.prompt_order
    restarted.commit(again, "x")
    restarted.prepare("d", "q", blocks(7, 2, 1, 3), tenant="someone-else")
    scheme = restarted.store.key_scheme
    client = redis.Redis.from_url(redis_url())
    assert client.hget(scheme.decision_keys("someone-else")[2], "#seen") == b"1"  # its own, fresh state
    assert client.hget(scheme.decision_keys("default")[2], "#seen") == b"3"
    assert not set(scheme.decision_keys("someone-else")) & set(scheme.decision_keys("default"))
    client.close()


def _with_limits(store: RedisSessionStore, **limits) -> RedisSessionStore:
    store._decisions = type(store._decisions)(store._decisions.keys, DecisionLimits(**limits))
    return store


def _draw(rng: random.Random, topical: bool) -> list[int]:
    """A request's documents: any 1-8 of 40, or (topical) mostly from one of 5 overlapping topics of 10, so the
    co-occurrence extension has similar earlier requests to follow."""
    if not topical:
        return rng.sample(range(40), rng.randint(1, 8))
    topic = rng.randrange(5)
    ids = rng.sample(range(topic * 6, topic * 6 + 10), rng.randint(2, 7))
    return list(dict.fromkeys(ids + ([rng.randrange(40)] if rng.random() < 0.3 else [])))


# fanout 2: nodes turn wide (one field per child) and keep narrow children; equal sizes: ties everywhere
@pytest.mark.parametrize(("fanout", "topical", "equal"),
                         [(128, False, False), (2, False, False), (128, True, False), (2, True, True)])
def test_the_lua_orderer_gives_the_python_orderer_s_orders(prefix, fanout, topical, equal):
    rng = random.Random(5)
    store = _with_limits(RedisSessionStore.from_url(redis_url(), RedisStoreConfig(prefix=prefix)), fanout=fanout,
                         max_requests=60)
    local = OnlineOrderer(max_requests=60)
    for number in range(300):
        ids = _draw(rng, topical)
        keys = [f"k{i:02d}" for i in ids]
        sizes = [10.0 if equal else float(len(TEXTS[i]) + 1) for i in ids]
        local.observe(keys)
        expected = local.order(keys, sizes)
        local.record(expected, f"r{number}")
        assert store.decide_order("t", keys, sizes, f"r{number}") == expected, number
        if number % 7 == 3:
            local.evict(f"r{number - 2}")
            store.evict_decisions("t", [f"r{number - 2}"])
    store.check_decisions("t")
    recorded = list(local._paths)
    local_nodes = _trie_nodes(local)
    assert store.evict_decisions("t", recorded) == len(recorded)
    client = redis.Redis.from_url(redis_url())
    trie = store.key_scheme.decision_keys("t")[0]
    assert local_nodes > 10 and client.hlen(trie) == 0  # every node and children field went with the last request
    client.close()


def _trie_nodes(orderer: OnlineOrderer) -> int:
    stack, count = list(orderer._root.children.values()), 0
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count


@pytest.mark.parametrize("direct", [True, False])  # False: through redis-py's pipeline (no SCRIPT EXISTS first)
def test_a_request_costs_two_round_trips_in_all(prefix, direct):
    sends = []

    class Counting(redis.Connection):
        def send_packed_command(self, command, check_health=True):
            sends.append(1)
            super().send_packed_command(command, check_health)

    pool = redis.ConnectionPool.from_url(redis_url(), connection_class=Counting)
    store = RedisSessionStore(redis.Redis(connection_pool=pool), RedisStoreConfig(prefix=prefix), direct=direct)
    memory = CpMemory(store=store)
    memory.commit(memory.prepare("warm", "q", blocks(1, 2)), "a")  # the scripts are loaded once per server
    sends.clear()
    turn = memory.prepare("c", "q", blocks(4, 5, 6))
    assert len(sends) == 1 and turn.prompt_order and not turn.degraded
    memory.commit(turn, "a")
    assert len(sends) == 2


def test_an_asyncio_request_costs_two_round_trips_in_all(prefix):
    import redis.asyncio as aioredis

    sends = []

    class Counting(aioredis.Connection):
        async def send_packed_command(self, command, check_health=True):
            sends.append(1)
            await super().send_packed_command(command, check_health)

    async def run():
        pool = aioredis.ConnectionPool.from_url(redis_url(), connection_class=Counting)
        store = AsyncRedisSessionStore(aioredis.Redis(connection_pool=pool), RedisStoreConfig(prefix=prefix))
        memory = AsyncCpMemory(store=store)
        await memory.commit(await memory.prepare("warm", "q", blocks(1, 2)), "a")
        sends.clear()
        turn = await memory.prepare("c", "q", blocks(4, 5, 6))
        prepared = len(sends)
        await memory.commit(turn, "a")
        await store.close()
        return prepared, len(sends), memory.counters.snapshot()["fallbacks"]

    assert asyncio.run(run()) == (1, 2, 0)


@pytest.mark.cluster
def test_facades_on_a_cluster_decide_as_one(redis_cluster):
    config = RedisStoreConfig(prefix=f"cpmtest-dec-{uuid.uuid4().hex[:8]}")
    first = CpMemory(store=RedisSessionStore.from_url(redis_cluster.url, config, cluster=True))
    second = CpMemory(store=RedisSessionStore.from_url(redis_cluster.url, config, cluster=True))
    turn = first.prepare("a", "q", blocks(3, 1, 2), prompt_order=["3", "1", "2"])
    first.commit(turn, "x")
    other = second.prepare("b", "q", blocks(1, 2, 3))
    assert other.prompt_order == ["3", "1", "2"] and not other.degraded  # the shared order, across nodes

    async def run():
        memory = AsyncCpMemory(store=AsyncRedisSessionStore.from_url(redis_cluster.url, config, cluster=True))
        again = await memory.prepare("c", "q", blocks(2, 3, 1))
        await memory.commit(again, "x")
        await memory.store.close()
        return again

    again = asyncio.run(run())
    assert again.prompt_order == ["3", "1", "2"] and not again.degraded
    assert first.counters.snapshot()["fallbacks"] == second.counters.snapshot()["fallbacks"] == 0


def _cluster_turns(memory, tenants: int = 6, turns: int = 3):
    """(tenant, turn number, prompt) for ``turns`` turns of two conversations of each of ``tenants`` tenants, the
    caller's history given (a first turn walks the shared trie and is recorded; a later one is counted only)."""
    for tenant in range(tenants):
        for conversation in range(2):
            history = []
            for turn in range(turns):
                ids = [(tenant * 7 + conversation * 3 + turn + step) % 40 for step in range(4)]
                yield f"tenant-{tenant}", turn, ids, history
                history = [*history, {"role": "user", "content": f"q{turn}"}, {"role": "assistant", "content": "a"}]


def _counting_cluster(url: str, prefix: str, direct: bool):
    from redis.cluster import RedisCluster

    sends = []

    class Counting(redis.Connection):
        def send_packed_command(self, command, check_health=True):
            sends.append(1)
            super().send_packed_command(command, check_health)

    config = RedisStoreConfig(prefix=prefix)
    client = RedisCluster.from_url(url, **config.client_kwargs(), connection_class=Counting)
    return RedisSessionStore(client, config, direct=direct), sends


@pytest.mark.cluster
@pytest.mark.parametrize("direct", [True, False])  # False: through redis-py (each node's own pipeline)
def test_a_request_on_a_cluster_costs_two_round_trips_in_all(redis_cluster, direct):
    # Six tenants (their slots spread over the three masters), two conversations each, first and later turns: the
    # conversation's keys and the tenant's decision keys share the tenant's hash tag, so each of prepare and
    # commit is one round trip to one node (before: one per node, 2.55 per request in the store bench).
    store, sends = _counting_cluster(redis_cluster.url, f"cpmtest-dec-{uuid.uuid4().hex[:8]}", direct)
    memory = CpMemory(store=store)
    nodes = {store.client.get_node_from_key(store.key_scheme.decision_keys(f"tenant-{n}")[0]).name for n in range(6)}
    for tenant in range(6):  # the scripts are loaded once per node (NOSCRIPT), outside the counts
        memory.commit(memory.prepare("warm", "q", blocks(1, 2), history=[], tenant=f"tenant-{tenant}"), "a")
    counts = []
    for tenant, turn, ids, history in _cluster_turns(memory):
        sends.clear()
        prepared = memory.prepare(f"c{len(counts)}", "q", blocks(*ids), history=history, tenant=tenant)
        at_prepare = len(sends)
        memory.commit(prepared, "a")
        assert prepared.prompt_order and not prepared.degraded
        counts.append((turn, at_prepare, len(sends)))
    store.close()
    assert len(nodes) >= 2  # the tenants do live on different nodes
    assert {(at_prepare, total) for _, at_prepare, total in counts} == {(1, 2)}, counts
    assert {turn for turn, _, _ in counts} == {0, 1, 2}
    assert memory.counters.snapshot()["fallbacks"] == 0


@pytest.mark.cluster
def test_a_moved_slot_is_followed_on_a_cluster(redis_cluster):
    # A client whose slot map sends the tenant's calls to the wrong node gets MOVED: the cluster client follows it
    # and refreshes its map, and the next request is one round trip again, on the right node.
    store, sends = _counting_cluster(redis_cluster.url, f"cpmtest-dec-{uuid.uuid4().hex[:8]}", True)
    memory = CpMemory(store=store)
    memory.commit(memory.prepare("warm", "q", blocks(1, 2), history=[]), "a")
    slot = store.client.keyslot(store.key_scheme.decision_keys("default")[0])
    right = store.client.nodes_manager.slots_cache[slot][0]
    wrong = next(node for node in store.client.get_primaries() if node.name != right.name)
    store.client.nodes_manager.slots_cache[slot] = [wrong]
    turn = memory.prepare("a", "q", blocks(3, 1, 2), history=[])
    memory.commit(turn, "a")
    assert turn.prompt_order and not turn.degraded
    assert store.client.nodes_manager.slots_cache[slot][0].name == right.name
    sends.clear()
    again = memory.prepare("b", "q", blocks(3, 1, 2), history=[])
    assert len(sends) == 1 and again.prompt_order == turn.prompt_order and not again.degraded
    assert memory.counters.snapshot()["fallbacks"] == 0
    store.close()


@pytest.mark.cluster
def test_an_asyncio_request_on_a_cluster_costs_two_round_trips_in_all(redis_cluster, monkeypatch):
    from redis.asyncio.connection import Connection

    sends = []
    send = Connection.send_packed_command

    async def counting(self, command, check_health=True):  # the asyncio cluster client takes no connection_class
        sends.append(1)
        await send(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", counting)

    async def run():
        # generous timeouts: the warm-up opens a connection to every master, which a loaded CI machine has timed out
        # (the store then serves pass-through, as it should, and the count below would include that fallback)
        config = RedisStoreConfig(prefix=f"cpmtest-dec-{uuid.uuid4().hex[:8]}", socket_timeout_s=5.0,
                                  connect_timeout_s=5.0)
        store = AsyncRedisSessionStore.from_url(redis_cluster.url, config, cluster=True)
        memory = AsyncCpMemory(store=store)
        for tenant in range(6):
            warm = await memory.prepare("warm", "q", blocks(1, 2), history=[], tenant=f"tenant-{tenant}")
            await memory.commit(warm, "a")
        warm_fallbacks = memory.counters.snapshot()["fallbacks"]
        counts = []
        for tenant, turn, ids, history in _cluster_turns(memory):
            sends.clear()
            prepared = await memory.prepare(f"c{len(counts)}", "q", blocks(*ids), history=history, tenant=tenant)
            at_prepare = len(sends)
            await memory.commit(prepared, "a")
            assert prepared.prompt_order and not prepared.degraded
            counts.append((turn, at_prepare, len(sends)))
        await store.close()
        return counts, memory.counters.snapshot()["fallbacks"] - warm_fallbacks

    counts, fallbacks = asyncio.run(run())
    assert {(at_prepare, total) for _, at_prepare, total in counts} == {(1, 2)}, counts
    assert fallbacks == 0


def test_evictions_and_the_bound_take_requests_off_the_shared_state(prefix):
    store = _with_limits(RedisSessionStore.from_url(redis_url(), RedisStoreConfig(prefix=prefix)), max_requests=2)
    store.decide_order("t", ["a", "b"], [1.0, 1.0], "r1")
    assert store.decide_order("t", ["b", "a", "z"], [1.0, 1.0, 1.0], "")[:2] == ["a", "b"]
    assert store.evict_decisions("t", ["r1"]) == 1 and store.evict_decisions("t", ["r1"]) == 0
    client = redis.Redis.from_url(redis_url())
    counts = client.hgetall(store.key_scheme.decision_keys("t")[0])
    assert not counts  # every node of the evicted path is gone
    for number in range(5):
        store.decide_order("t", [f"x{number}"], [1.0], f"q{number}")
    assert client.hlen(store.key_scheme.decision_keys("t")[3]) == 2  # only the last max_requests are kept
    client.close()


def test_the_async_facade_shares_the_same_state(prefix):
    sync = facade(prefix)
    turn = sync.prepare("a", "q", blocks(11, 12, 13))
    sync.commit(turn, "x")

    async def run():
        memory = AsyncCpMemory(store=AsyncRedisSessionStore.from_url(redis_url(), RedisStoreConfig(prefix=prefix)))
        other = await memory.prepare("b", "q", blocks(13, 12, 11, 14))
        await memory.commit(other, "x")
        await memory.store.close()
        return other

    other = asyncio.run(run())
    assert other.prompt_order[:3] == turn.prompt_order


def _trie_fields(store, tenant="default"):
    client = redis.Redis.from_url(redis_url())
    try:
        return client.hlen(store.key_scheme.decision_keys(tenant)[0])
    finally:
        client.close()


def test_the_kv_event_thread_s_evictions_reach_the_shared_state_sync(prefix):
    memory = facade(prefix)
    turn = memory.prepare("a", "q", blocks(1, 2, 3))
    memory.commit(turn, "x")
    assert turn.request_id and _trie_fields(memory.store) > 0
    evictor = memory.index_evictor()
    worker = threading.Thread(target=evictor.evict, args=([turn.request_id],))  # as EvictionSync's thread does
    worker.start()
    worker.join()
    assert _trie_fields(memory.store) == 0  # the engine evicted it: no worker's orders follow it any more


def test_the_kv_event_thread_s_evictions_reach_the_shared_state_async(prefix):
    async def run():
        memory = AsyncCpMemory(store=AsyncRedisSessionStore.from_url(redis_url(), RedisStoreConfig(prefix=prefix)))
        turn = await memory.prepare("a", "q", blocks(1, 2, 3))
        await memory.commit(turn, "x")
        before = _trie_fields(memory.store)
        evictor = memory.index_evictor()  # built in the loop, as the proxy's KV sync does
        await asyncio.to_thread(evictor.evict, [turn.request_id])  # the subscriber thread
        for _ in range(100):  # scheduled on the loop: give it the turn
            if _trie_fields(memory.store) == 0:
                break
            await asyncio.sleep(0.01)
        after = _trie_fields(memory.store)
        second = await memory.prepare("b", "q", blocks(4, 5))
        await memory.commit(second, "x")
        assert await memory.evict([second.request_id]) == 1  # the async facade's own evict reaches it too
        last = _trie_fields(memory.store)
        await memory.store.close()
        return before, after, last

    before, after, last = asyncio.run(run())
    assert before > 0 and after == 0 and last == 0


def test_a_later_turn_is_counted_but_not_matched(prefix):
    memory = facade(prefix)
    client = redis.Redis.from_url(redis_url())
    freq = memory.store.key_scheme.decision_keys("default")[2]
    sent = memory.prepare("a", "q", blocks(0, 3), prompt_order=["0", "3"])  # the small block first, recorded
    memory.commit(sent, "x")
    opening = memory.prepare("b", "q", blocks(3, 0))
    assert opening.prompt_order == ["0", "3"]  # a first turn follows the recorded order (the match)
    memory.commit(opening, "x")
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "answer"}]
    later = memory.prepare("c", "q", blocks(3, 0), history=history)
    # no recorded order is a prefix of a prompt that opens with history: the extension alone, by size x odds
    assert later.prompt_order == ["3", "0"] and not later.degraded
    assert client.hget(freq, "#seen") == b"2"  # still counted (the opening turn and this one)
    memory.commit(later.reservation_id, "x")  # by id (the facade's pending copy): still not recorded
    with_system = memory.prepare("d", "q", blocks(3, 0), history=[{"role": "system", "content": "be brief"}])
    assert with_system.prompt_order == ["0", "3"]  # a system message alone still opens the conversation
    client.close()

