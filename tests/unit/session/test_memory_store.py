"""InMemorySessionStore / AsyncInMemorySessionStore: two-phase turns, TTL, timeouts, tenants, threads."""

from __future__ import annotations

import threading

import pytest

from cpmemory.errors import InvalidInputError, ReservationExpiredError, UnknownReservationError
from cpmemory.stores.base import (
    AsyncSessionStore,
    ConversationKey,
    ReserveRequest,
    SeenBlock,
    SessionStore,
    TurnRecord,
)
from cpmemory.stores.memory import AsyncInMemorySessionStore, InMemorySessionStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


KEY = ConversationKey("tenant-a", "conv-1")


def record(*hashes: str, text: str = "u") -> TurnRecord:
    shown = tuple(SeenBlock(f"id-{h}", h, f"D{h}", 0) for h in hashes)
    return TurnRecord(
        ({"role": "user", "content": text}, {"role": "assistant", "content": "a"}), shown, (0, 1)
    )


def request(*hashes: str, timeout: float = 10.0) -> ReserveRequest:
    return ReserveRequest(tuple((f"id-{h}", h) for h in hashes), timeout)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> InMemorySessionStore:
    return InMemorySessionStore(ttl_s=100.0, clock=clock)


def test_implements_the_protocols() -> None:
    assert isinstance(InMemorySessionStore(), SessionStore)
    assert isinstance(AsyncInMemorySessionStore(), AsyncSessionStore)


def test_reserve_sees_only_committed_state(store: InMemorySessionStore) -> None:
    first = store.reserve(KEY, request("h1"))
    second = store.reserve(KEY, request("h1"))
    assert first.seen == {} and second.seen == {}
    assert store.commit(KEY, first.reservation_id, record("h1")) == 1
    third = store.reserve(KEY, request("h1", "h2"))
    assert set(third.seen) == {"h1"} and third.seen["h1"].turn == 1
    assert third.previous_hash_for_id == {"id-h1": "h1"}
    assert third.turn == 1 and third.last_search_path == (0, 1)
    assert third.transcript is not None and len(third.transcript) == 2
    assert store.commit(KEY, second.reservation_id, record()) == 2


def test_double_commit_is_idempotent(store: InMemorySessionStore) -> None:
    reservation = store.reserve(KEY, request("h1"))
    assert store.commit(KEY, reservation.reservation_id, record("h1")) == 1
    assert store.commit(KEY, reservation.reservation_id, record("h1")) == 1
    state = store.load(KEY)
    assert state.turns == 1 and len(state.transcript) == 2


def test_unknown_and_aborted_reservations(store: InMemorySessionStore) -> None:
    with pytest.raises(UnknownReservationError):
        store.commit(KEY, "never-made", record())
    reservation = store.reserve(KEY, request("h1"))
    assert store.abort(KEY, reservation.reservation_id) is True
    assert store.abort(KEY, reservation.reservation_id) is False
    with pytest.raises(UnknownReservationError):
        store.commit(KEY, reservation.reservation_id, record("h1"))
    assert store.load(KEY).turns == 0 and store.load(KEY).seen == {}


def test_reservation_timeout(store: InMemorySessionStore, clock: FakeClock) -> None:
    reservation = store.reserve(KEY, request("h1", timeout=5.0))
    clock.now += 6.0
    with pytest.raises(ReservationExpiredError):
        store.commit(KEY, reservation.reservation_id, record("h1"))
    state = store.load(KEY)
    assert state.turns == 0 and state.seen == {} and state.open_reservations == 0


def test_ttl_expiry_reads_as_empty_and_is_refreshed_on_use(
    store: InMemorySessionStore, clock: FakeClock
) -> None:
    reservation = store.reserve(KEY, request("h1"))
    store.commit(KEY, reservation.reservation_id, record("h1"))
    clock.now += 90.0
    assert store.load(KEY).turns == 1  # refreshes the TTL
    clock.now += 90.0
    assert store.load(KEY).turns == 1
    clock.now += 101.0
    assert store.load(KEY).turns == 0
    assert store.reserve(KEY, request("h1")).seen == {}


def test_tenants_are_isolated(store: InMemorySessionStore) -> None:
    other = ConversationKey("tenant-b", "conv-1")
    reservation = store.reserve(KEY, request("h1"))
    store.commit(KEY, reservation.reservation_id, record("h1"))
    assert store.reserve(other, request("h1")).seen == {}
    with pytest.raises(UnknownReservationError):
        store.commit(other, reservation.reservation_id, record("h1"))
    assert store.abort(other, store.reserve(KEY, request()).reservation_id) is False
    store.delete(other)
    assert store.load(KEY).turns == 1


def test_bad_ttl() -> None:
    with pytest.raises(InvalidInputError):
        InMemorySessionStore(ttl_s=0)


def test_concurrent_commits_number_turns_exactly_once() -> None:
    store = InMemorySessionStore()
    reservations = [store.reserve(KEY, request(f"h{i}")) for i in range(200)]
    results: list[int] = []
    lock = threading.Lock()

    def worker(chunk: list) -> None:
        for reservation in chunk:
            number = store.commit(KEY, reservation.reservation_id, record(f"h{reservation.turn}"))
            with lock:
                results.append(number)

    threads = [threading.Thread(target=worker, args=(reservations[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == list(range(1, 201))
    assert store.load(KEY).turns == 200 and len(store.load(KEY).transcript) == 400


async def test_async_store_shares_the_contract() -> None:
    store = AsyncInMemorySessionStore(ttl_s=None)
    reservation = await store.reserve(KEY, request("h1"))
    assert await store.commit(KEY, reservation.reservation_id, record("h1")) == 1
    assert await store.commit(KEY, reservation.reservation_id, record("h1")) == 1
    assert await store.abort(KEY, "nope") is False
    assert (await store.load(KEY)).turns == 1
    await store.delete(KEY)
    assert (await store.load(KEY)).turns == 0


def test_expired_conversations_are_swept(clock: FakeClock) -> None:
    from cpmemory.stores.memory import SWEEP_EVERY

    store = InMemorySessionStore(ttl_s=10.0, clock=clock)
    for i in range(50):
        store.reserve(ConversationKey("t", f"old-{i}"), request())
    clock.now += 11.0
    for _ in range(SWEEP_EVERY):
        store.load(KEY)
    assert len(store) <= 1
