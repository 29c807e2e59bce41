"""The Redis store on the real Redis: one round trip per call, NOSCRIPT recovery, thread safety of the direct
script path, large turns chunked inside the scripts, many stores sharing one client's pool."""
from __future__ import annotations

from typing import Any

import pytest

from cpmemory.bench.store_bench import RoundTripCounter
from cpmemory.core.blocks import content_hash, label_for_hash
from cpmemory.stores.redis_store import RedisSessionStore, RedisStoreConfig
from cpmemory.types import ConversationKey, ReserveRequest, SeenBlock, TurnRecord

redis = pytest.importorskip("redis")


def _pairs(*texts: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"id-{text}", content_hash(text)) for text in texts)


def _record(pairs: tuple[tuple[str, str], ...]) -> TurnRecord:
    shown = tuple(SeenBlock(i, h, label_for_hash(h), 0) for i, h in pairs)
    return TurnRecord(({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}), shown, (1,))


@pytest.mark.redis
def test_one_round_trip_per_call_on_real_redis(real_redis: str, run_prefix: str) -> None:
    counter = RoundTripCounter()
    config = RedisStoreConfig(prefix=run_prefix)
    client = redis.Redis.from_url(real_redis, connection_class=counter.connection_class())
    store = RedisSessionStore(client, config)
    key = ConversationKey("tenant", "round-trips")
    warm = store.reserve(key, ReserveRequest(blocks=()))  # first use loads the scripts (NOSCRIPT + LOAD)
    store.commit(key, warm.reservation_id, TurnRecord((), ()))
    store.abort(key, store.reserve(key, ReserveRequest(blocks=())).reservation_id)
    for turn in range(5):
        pairs = _pairs(*(f"block {turn} {i}" for i in range(15)))
        before = counter.sends
        reservation = store.reserve(key, ReserveRequest(blocks=pairs))
        assert counter.sends - before == 1
        store.commit(key, reservation.reservation_id, _record(pairs))
        assert counter.sends - before == 2
    store.delete(key)
    client.close()


@pytest.mark.redis
def test_script_cache_flush_on_real_redis_recovers(real_redis: str, run_prefix: str) -> None:
    client = redis.Redis.from_url(real_redis)
    store = RedisSessionStore(client, RedisStoreConfig(prefix=run_prefix))
    key = ConversationKey("tenant", "noscript")
    reservation = store.reserve(key, ReserveRequest(blocks=_pairs("x")))
    client.script_flush()
    assert store.commit(key, reservation.reservation_id, _record(_pairs("x"))) == 1
    store.delete(key)
    client.close()


def _hammer(store: RedisSessionStore, key: ConversationKey, worker: int, turns: int) -> list[int]:
    numbers = []
    for turn in range(turns):
        pairs = _pairs(f"w{worker}-t{turn}", "shared")
        reservation = store.reserve(key, ReserveRequest(blocks=pairs, include_transcript=False))
        numbers.append(store.commit(key, reservation.reservation_id, _record(pairs)))
    return numbers


@pytest.mark.redis
def test_direct_path_is_thread_safe(real_redis: str, run_prefix: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    store = RedisSessionStore.from_url(real_redis, RedisStoreConfig(prefix=run_prefix, socket_timeout_s=5.0))
    key = ConversationKey("tenant", "threads")
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda worker: _hammer(store, key, worker, 25), range(8)))
    numbers = sorted(number for numbers in results for number in numbers)
    assert numbers == list(range(1, 201))
    state = store.load(key)
    assert state.turns == 200 and len(state.transcript) == 400 and state.open_reservations == 0
    store.delete(key)
    store.close()


@pytest.mark.redis
def test_large_turns_are_chunked_inside_the_scripts(real_redis: str, run_prefix: str) -> None:
    store = RedisSessionStore.from_url(real_redis, RedisStoreConfig(prefix=run_prefix, socket_timeout_s=10.0))
    key = ConversationKey("tenant", "large")
    pairs = tuple((f"block-{i}", content_hash(f"text {i}")) for i in range(6000))  # > Lua's unpack limit
    reservation = store.reserve(key, ReserveRequest(blocks=pairs))
    assert store.commit(key, reservation.reservation_id, _record(pairs)) == 1
    again = store.reserve(key, ReserveRequest(blocks=pairs, include_transcript=False))
    assert len(again.seen) == 6000 and len(again.previous_hash_for_id) == 6000
    assert again.seen[pairs[-1][1]] == SeenBlock("block-5999", pairs[-1][1], label_for_hash(pairs[-1][1]), 1)
    store.delete(key)
    store.close()


@pytest.mark.redis
def test_many_stores_on_one_client_do_not_run_its_pool_dry(real_redis: str, run_prefix: str) -> None:

    client: Any = redis.Redis.from_url(real_redis, max_connections=8)
    stores = [RedisSessionStore(client, RedisStoreConfig(prefix=run_prefix)) for _ in range(100)]
    key = ConversationKey("tenant", "pool")
    for store in stores:
        reservation = store.reserve(key, ReserveRequest(blocks=()))
        store.abort(key, reservation.reservation_id)
    assert stores[0].load(key).open_reservations == 0
    stores[0].delete(key)
    client.close()
