"""Redis-specific behaviour on fakeredis: outage mapping, NOSCRIPT recovery, config validation, both script paths,
TTLs, and a model-based check that the Redis store and the in-memory store agree on every operation sequence (the
real Redis: tests/integration/stores/test_redis_store_real.py)."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.blocks import content_hash, label_for_hash
from cpmemory.errors import (
    InvalidIdentifierError,
    InvalidInputError,
    ReservationError,
    StoreUnavailableError,
)
from cpmemory.stores.memory import InMemorySessionStore
from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisSessionStore, RedisStoreConfig
from cpmemory.testing.local_redis import spare_port
from cpmemory.types import ConversationKey, ReserveRequest, SeenBlock, TurnRecord

redis = pytest.importorskip("redis")
fakeredis = pytest.importorskip("fakeredis")
pytest.importorskip("lupa")

FAST_FAIL = RedisStoreConfig(socket_timeout_s=0.1, connect_timeout_s=0.1, retries=0)


def _pairs(*texts: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"id-{text}", content_hash(text)) for text in texts)


def _record(pairs: tuple[tuple[str, str], ...]) -> TurnRecord:
    shown = tuple(SeenBlock(i, h, label_for_hash(h), 0) for i, h in pairs)
    return TurnRecord(({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}), shown, (1,))


def test_unreachable_redis_raises_store_unavailable() -> None:
    store = RedisSessionStore.from_url(f"redis://127.0.0.1:{spare_port()}/0", FAST_FAIL)
    key = ConversationKey("t", "c")
    with pytest.raises(StoreUnavailableError):
        store.reserve(key, ReserveRequest(blocks=_pairs("a")))
    with pytest.raises(StoreUnavailableError):
        store.commit(key, "r", _record(_pairs("a")))
    with pytest.raises(StoreUnavailableError):
        store.load(key)
    with pytest.raises(StoreUnavailableError):
        store.delete(key)


def test_unreachable_cluster_raises_store_unavailable() -> None:
    with pytest.raises(StoreUnavailableError):  # redis-py's cluster client connects in its constructor
        RedisSessionStore.from_url(f"redis://127.0.0.1:{spare_port()}/0", FAST_FAIL, cluster=True)


async def test_unreachable_cluster_raises_store_unavailable_async() -> None:
    store = AsyncRedisSessionStore.from_url(f"redis://127.0.0.1:{spare_port()}/0", FAST_FAIL, cluster=True)
    with pytest.raises(StoreUnavailableError):
        await store.reserve(ConversationKey("t", "c"), ReserveRequest(blocks=_pairs("a")))
    await store.close()


async def test_unreachable_redis_raises_store_unavailable_async() -> None:
    store = AsyncRedisSessionStore.from_url(f"redis://127.0.0.1:{spare_port()}/0", FAST_FAIL)
    with pytest.raises(StoreUnavailableError):
        await store.reserve(ConversationKey("t", "c"), ReserveRequest(blocks=_pairs("a")))
    with pytest.raises(StoreUnavailableError):
        await store.abort(ConversationKey("t", "c"), "r")
    await store.close()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="key prefix"):  # pydantic wraps InvalidIdentifierError
        RedisStoreConfig(prefix="bad{prefix}")
    with pytest.raises(InvalidIdentifierError):
        RedisSessionStore(fakeredis.FakeRedis(), RedisStoreConfig.model_construct(prefix="a}b"))
    with pytest.raises(ValueError):
        RedisStoreConfig(ttl_s=-1)


def test_decoding_clients_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="decode_responses"):
        RedisSessionStore(fakeredis.FakeRedis(decode_responses=True))
    with pytest.raises(InvalidInputError, match="decode_responses"):
        AsyncRedisSessionStore(fakeredis.FakeAsyncRedis(decode_responses=True))


def test_scripts_reload_after_script_flush() -> None:
    client = fakeredis.FakeRedis()
    store = RedisSessionStore(client, RedisStoreConfig(prefix="flush"))
    key = ConversationKey("t", "c")
    reservation = store.reserve(key, ReserveRequest(blocks=_pairs("a")))
    client.script_flush()  # what a server restart does to the script cache
    assert store.commit(key, reservation.reservation_id, _record(_pairs("a"))) == 1
    assert set(store.reserve(key, ReserveRequest(blocks=_pairs("a"))).seen) == {content_hash("a")}


operations = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "commit", "abort", "commit_again", "delete"]),
        st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), max_size=4, unique=True),
        st.sampled_from(["x", "y"]),  # block id variant: same text under another id
        st.integers(min_value=0, max_value=3),  # which open reservation
    ),
    max_size=25,
)


def _outcome(call):  # type: ignore[no-untyped-def]
    try:
        return call()
    except ReservationError as error:
        return type(error).__name__


@settings(max_examples=60, deadline=None)
@given(operations)
def test_redis_store_matches_in_memory_store(steps) -> None:  # type: ignore[no-untyped-def]
    stores = [InMemorySessionStore(), RedisSessionStore(fakeredis.FakeRedis(), RedisStoreConfig(prefix="model"))]
    key = ConversationKey("tenant", "model")
    open_ids: list[list[str]] = [[], []]
    done_ids: list[list[str]] = [[], []]
    for action, texts, variant, which in steps:
        pairs = tuple((f"{variant}-{text}", content_hash(text)) for text in texts)
        results = []
        for index, store in enumerate(stores):
            results.append(_step(store, key, action, pairs, which, open_ids[index], done_ids[index]))
        assert results[0] == results[1], (action, results)
        assert _state(stores[0].load(key)) == _state(stores[1].load(key))


def _step(store, key, action, pairs, which, open_ids, done_ids):  # type: ignore[no-untyped-def]
    if action == "reserve":
        reservation = store.reserve(key, ReserveRequest(blocks=pairs))
        open_ids.append(reservation.reservation_id)
        return (reservation.turn, dict(reservation.seen), dict(reservation.previous_hash_for_id),
                reservation.transcript, reservation.last_search_path)
    if action == "delete":
        store.delete(key)
        return None
    pool = done_ids if action == "commit_again" else open_ids
    if not pool:
        return "nothing to do"
    reservation_id = pool[which % len(pool)]
    if action == "abort":
        open_ids.remove(reservation_id)
        return store.abort(key, reservation_id)
    outcome = _outcome(lambda: store.commit(key, reservation_id, _record(pairs)))
    if reservation_id in open_ids:
        open_ids.remove(reservation_id)
        done_ids.append(reservation_id)
    return outcome


def _state(state):  # type: ignore[no-untyped-def]
    return (state.turns, dict(state.seen), dict(state.ids), state.transcript, state.search_paths,
            state.open_reservations)


def test_async_and_sync_stores_share_one_encoding() -> None:
    server = fakeredis.FakeServer()
    config = RedisStoreConfig(prefix="shared")
    sync_store = RedisSessionStore(fakeredis.FakeRedis(server=server), config)
    async_store = AsyncRedisSessionStore(fakeredis.FakeAsyncRedis(server=server), config)
    key = ConversationKey("tenant", "mixed")
    reservation = sync_store.reserve(key, ReserveRequest(blocks=_pairs("a", "b")))

    async def scenario() -> tuple[int, object]:
        turn = await async_store.commit(key, reservation.reservation_id, _record(_pairs("a", "b")))
        return turn, await async_store.load(key)

    turn, state = asyncio.run(scenario())
    assert turn == 1 and state == sync_store.load(key)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "redis-py-script"])
def test_both_script_paths_agree(direct: bool) -> None:
    client = fakeredis.FakeRedis()
    store = RedisSessionStore(client, RedisStoreConfig(prefix="paths"), direct=direct)
    key = ConversationKey("tenant", "paths")
    reservation = store.reserve(key, ReserveRequest(blocks=_pairs("a", "b")))
    client.script_flush()
    assert store.commit(key, reservation.reservation_id, _record(_pairs("a"))) == 1
    again = store.reserve(key, ReserveRequest(blocks=_pairs("a", "b")))
    assert set(again.seen) == {content_hash("a")} and again.transcript[0]["content"] == "q"
    store.close()


@pytest.mark.parametrize("ttl_s", [0.0, 600.0])
def test_every_key_gets_the_ttl(ttl_s: float) -> None:
    client = fakeredis.FakeRedis()
    store = RedisSessionStore(client, RedisStoreConfig(prefix="ttl", ttl_s=ttl_s))
    key = ConversationKey("tenant", "ttl")
    pending = store.reserve(key, ReserveRequest(blocks=_pairs("a")))
    assert client.pttl(store.key_scheme.keys(key).res) == (-1 if ttl_s == 0 else pytest.approx(600_000, abs=5_000))
    store.commit(key, pending.reservation_id, _record(_pairs("a")))
    store.reserve(key, ReserveRequest(blocks=_pairs("a")))
    names = store.key_scheme.keys(key).all()
    assert client.exists(*names) == len(names)  # state, log, paths, res (one open), done
    for name in names:  # no key is ever left without the conversation's expiry
        assert client.pttl(name) == (-1 if ttl_s == 0 else pytest.approx(600_000, abs=5_000))
