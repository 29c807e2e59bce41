"""The SessionStore contract (cpmemory/stores/base.py), one suite for every backend, sync and asyncio.

Each test body is written once against an awaitable store; the ``store`` fixture gives either a synchronous store
behind a thin awaiting adapter or the asyncio store itself, for each backend of conftest.py.
"""
from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from cpmemory.core.blocks import content_hash, label_for_hash
from cpmemory.errors import InvalidIdentifierError, ReservationExpiredError, UnknownReservationError
from cpmemory.stores.base import DEFAULT_MAX_TRANSCRIPT_TURNS
from cpmemory.types import ConversationKey, ReserveRequest, SeenBlock, TurnRecord

HOSTILE_IDS = [
    "{tag}",
    "a:b:c",
    "*",
    "with spaces and\ttabs\nnewlines",
    "x" * 1024,
    "日本語 🙂 ∑",
    "lone \udc80 surrogate",
    "nul\x00byte",
    "cpm:{deadbeef:cafe}:state",
    "}{",
]


class Awaiting:
    """Presents a store with awaitable methods, whether it is synchronous or asyncio."""

    def __init__(self, inner: Any, make_more: Callable[[], Any]) -> None:
        self.inner = inner
        self._make_more = make_more

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.inner, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return call

    def another(self) -> Awaiting:
        """A second store (another client / worker) on the same backend state."""
        return Awaiting(self._make_more(), self._make_more)

    async def aclose(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_store(backend: Any, mode: str) -> Callable[..., Awaiting]:
    """A factory of fresh stores of this backend and mode; a test closes what it makes (``aclose``)."""

    def make(ttl_s: float = 3600.0, max_transcript_turns: int = DEFAULT_MAX_TRANSCRIPT_TURNS) -> Awaiting:
        factory = backend.make_sync if mode == "sync" else backend.make_async
        return Awaiting(factory(ttl_s, max_transcript_turns), lambda: factory(ttl_s, max_transcript_turns))

    return make


@pytest.fixture
async def store(make_store: Callable[..., Awaiting]) -> AsyncIterator[Awaiting]:
    made = make_store()
    yield made
    await made.aclose()


def conversation(tenant: str = "tenant-a") -> ConversationKey:
    return ConversationKey(tenant, f"conv-{uuid.uuid4().hex}")


def blocks(*texts: str, prefix: str = "doc") -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}-{i}", content_hash(text)) for i, text in enumerate(texts))


def shown(pairs: tuple[tuple[str, str], ...]) -> tuple[SeenBlock, ...]:
    return tuple(SeenBlock(block_id, digest, label_for_hash(digest), 0) for block_id, digest in pairs)


def record(pairs: tuple[tuple[str, str], ...], text: str = "q", path: tuple[int, ...] = ()) -> TurnRecord:
    messages = ({"role": "user", "content": text}, {"role": "assistant", "content": f"answer to {text}"})
    return TurnRecord(messages=messages, shown=shown(pairs), search_path=path)


async def commit_turn(store: Awaiting, key: ConversationKey, pairs: tuple[tuple[str, str], ...], text: str = "q",
                      path: tuple[int, ...] = ()) -> int:
    reservation = await store.reserve(key, ReserveRequest(blocks=pairs))
    return await store.commit(key, reservation.reservation_id, record(pairs, text, path))


async def test_new_conversation_reads_empty(store: Awaiting) -> None:
    key = conversation()
    reservation = await store.reserve(key, ReserveRequest(blocks=blocks("a", "b")))
    assert (reservation.turn, dict(reservation.seen), dict(reservation.previous_hash_for_id)) == (0, {}, {})
    assert reservation.transcript == () and reservation.last_search_path == ()
    without = await store.reserve(key, ReserveRequest(blocks=(), include_transcript=False))
    assert without.transcript is None
    assert reservation.reservation_id != without.reservation_id
    assert (await store.load(key)).open_reservations == 2


async def test_round_trip(store: Awaiting) -> None:
    key = conversation()
    first = blocks("alpha", "beta", "gamma")
    assert await commit_turn(store, key, first, "one", path=(0, 2)) == 1
    reservation = await store.reserve(key, ReserveRequest(blocks=first[1:] + blocks("delta", prefix="new")))
    assert reservation.turn == 1
    assert set(reservation.seen) == {first[1][1], first[2][1]}  # restricted to the request's hashes
    assert reservation.seen[first[1][1]] == SeenBlock("doc-1", first[1][1], label_for_hash(first[1][1]), 1)
    assert dict(reservation.previous_hash_for_id) == {"doc-1": first[1][1], "doc-2": first[2][1]}
    assert [m["content"] for m in reservation.transcript] == ["one", "answer to one"]
    assert reservation.last_search_path == (0, 2)
    assert await store.commit(key, reservation.reservation_id, record(blocks("delta", prefix="new"), "two", (1,))) == 2
    state = await store.load(key)
    assert state.turns == 2 and state.open_reservations == 0
    assert set(state.seen) == {h for _, h in first} | {content_hash("delta")}
    assert state.seen[content_hash("delta")].turn == 2
    assert state.ids["new-0"] == content_hash("delta")
    assert state.search_paths == ((0, 2), (1,))
    assert [m["role"] for m in state.transcript] == ["user", "assistant"] * 2


async def test_concurrent_reservations_see_only_committed_state(store: Awaiting) -> None:
    key = conversation()
    shared = blocks("shared", "one", "two")
    first = await store.reserve(key, ReserveRequest(blocks=shared))
    second = await store.reserve(key, ReserveRequest(blocks=shared))
    assert await store.commit(key, first.reservation_id, record(shared, "first")) == 1
    assert dict(second.seen) == {}  # reserved before the first commit: nothing of it is visible
    third = await store.reserve(key, ReserveRequest(blocks=shared))
    assert set(third.seen) == {h for _, h in shared} and third.turn == 1
    assert await store.commit(key, second.reservation_id, record(shared[:1], "second")) == 2
    state = await store.load(key)
    assert state.turns == 2 and state.seen[shared[0][1]].turn == 2 and state.seen[shared[1][1]].turn == 1
    assert state.open_reservations == 1


async def test_parallel_commits_get_distinct_turns(store: Awaiting) -> None:
    key = conversation()
    reservations = await asyncio.gather(*(store.reserve(key, ReserveRequest(blocks=blocks(f"t{i}"))) for i in range(8)))
    turns = await asyncio.gather(
        *(store.commit(key, r.reservation_id, record(blocks(f"t{i}"), f"q{i}")) for i, r in enumerate(reservations))
    )
    assert sorted(turns) == list(range(1, 9))
    state = await store.load(key)
    assert state.turns == 8 and len(state.transcript) == 16 and len(state.search_paths) == 8


async def test_double_commit_is_idempotent(store: Awaiting) -> None:
    key = conversation()
    pairs = blocks("a", "b")
    reservation = await store.reserve(key, ReserveRequest(blocks=pairs))
    assert await store.commit(key, reservation.reservation_id, record(pairs, "once")) == 1
    assert await store.commit(key, reservation.reservation_id, record(pairs, "twice")) == 1
    state = await store.load(key)
    assert state.turns == 1 and [m["content"] for m in state.transcript] == ["once", "answer to once"]
    assert len(state.search_paths) == 1
    assert await store.abort(key, reservation.reservation_id) is False


async def test_unknown_reservation(store: Awaiting) -> None:
    key = conversation()
    await commit_turn(store, key, blocks("a"))
    with pytest.raises(UnknownReservationError):
        await store.commit(key, "no-such-reservation", record(blocks("b")))
    with pytest.raises(UnknownReservationError):
        await store.commit(conversation(), "no-such-reservation", record(blocks("b")))
    assert await store.abort(key, "no-such-reservation") is False
    state = await store.load(key)
    assert state.turns == 1 and set(state.seen) == {content_hash("a")}


async def test_expired_reservation_records_nothing(backend: Any, store: Awaiting) -> None:
    key = conversation()
    pairs = blocks("late")
    reservation = await store.reserve(key, ReserveRequest(blocks=pairs, reservation_timeout_s=0.05))
    backend.sleep(0.1 + backend.timing_slack_s)
    with pytest.raises(ReservationExpiredError):
        await store.commit(key, reservation.reservation_id, record(pairs))
    other = await store.reserve(key, ReserveRequest(blocks=pairs))  # purges lazily; the id stays "expired"
    with pytest.raises(ReservationExpiredError):
        await store.commit(key, reservation.reservation_id, record(pairs))
    assert dict(other.seen) == {}
    state = await store.load(key)
    assert (state.turns, dict(state.seen), state.transcript, state.open_reservations) == (0, {}, (), 1)
    assert await store.abort(key, reservation.reservation_id) is False


async def test_abort_releases(store: Awaiting) -> None:
    key = conversation()
    pairs = blocks("never shown")
    reservation = await store.reserve(key, ReserveRequest(blocks=pairs))
    assert await store.abort(key, reservation.reservation_id) is True
    assert await store.abort(key, reservation.reservation_id) is False
    with pytest.raises(UnknownReservationError):
        await store.commit(key, reservation.reservation_id, record(pairs))
    later = await store.reserve(key, ReserveRequest(blocks=pairs))
    assert dict(later.seen) == {} and later.turn == 0  # an aborted turn is never referred to


async def test_ttl_expiry_reads_empty(backend: Any, make_store: Callable[..., Awaiting]) -> None:
    store = make_store(ttl_s=0.5)
    key = conversation()
    pairs = blocks("short-lived")
    assert await commit_turn(store, key, pairs) == 1
    backend.sleep(0.9 + backend.timing_slack_s)
    reservation = await store.reserve(key, ReserveRequest(blocks=pairs))
    assert (reservation.turn, dict(reservation.seen), reservation.transcript) == (0, {}, ())
    assert await store.commit(key, reservation.reservation_id, record(pairs)) == 1
    await store.aclose()


async def test_ttl_is_refreshed_by_use(backend: Any, make_store: Callable[..., Awaiting]) -> None:
    store = make_store(ttl_s=1.5)
    key = conversation()
    pairs = blocks("kept alive")
    await commit_turn(store, key, pairs)
    for _ in range(4):  # 4 x 0.5 s > the TTL, but every call refreshes it
        backend.sleep(0.5)
        reservation = await store.reserve(key, ReserveRequest(blocks=pairs))
        assert set(reservation.seen) == {pairs[0][1]}
        await store.abort(key, reservation.reservation_id)
    await store.aclose()


async def test_tenants_are_isolated(store: Awaiting) -> None:
    name = f"conv-{uuid.uuid4().hex}"
    alice, bob = ConversationKey("alice", name), ConversationKey("bob", name)
    pairs = blocks("secret")
    await commit_turn(store, alice, pairs, "alice's question")
    pending = await store.reserve(alice, ReserveRequest(blocks=pairs))
    seen_by_bob = await store.reserve(bob, ReserveRequest(blocks=pairs))
    assert (seen_by_bob.turn, dict(seen_by_bob.seen), seen_by_bob.transcript) == (0, {}, ())
    with pytest.raises(UnknownReservationError):
        await store.commit(bob, pending.reservation_id, record(pairs))
    assert await store.abort(bob, pending.reservation_id) is False
    await store.delete(bob)
    state = await store.load(alice)
    assert state.turns == 1 and state.open_reservations == 1 and set(state.seen) == {pairs[0][1]}


@pytest.mark.parametrize("hostile", HOSTILE_IDS, ids=range(len(HOSTILE_IDS)))
async def test_hostile_identifiers(store: Awaiting, hostile: str) -> None:
    key = ConversationKey(hostile, hostile)
    neighbour = ConversationKey(hostile[:1000] + ":", hostile[:-1] or "x")
    block_id = hostile * 10  # block ids are not length-limited: up to 10 KB here
    pairs = ((block_id, content_hash("hostile text")),)
    assert await commit_turn(store, key, pairs, hostile) == 1
    reservation = await store.reserve(key, ReserveRequest(blocks=pairs))
    assert reservation.seen[pairs[0][1]].block_id == block_id
    assert dict(reservation.previous_hash_for_id) == {block_id: pairs[0][1]}
    assert reservation.transcript[0]["content"] == hostile
    assert (await store.load(neighbour)).turns == 0
    state = await store.load(key)
    assert state.ids == {block_id: pairs[0][1]}
    await store.delete(key)
    assert (await store.load(key)).turns == 0


def test_identifiers_are_validated() -> None:
    with pytest.raises(InvalidIdentifierError):
        ConversationKey("", "c")
    with pytest.raises(InvalidIdentifierError):
        ConversationKey("t", "x" * 10_000)


async def test_changed_block_keeps_both_versions(store: Awaiting) -> None:
    key = conversation()
    old, new = ("doc", content_hash("version 1")), ("doc", content_hash("version 2"))
    await commit_turn(store, key, (old,))
    reservation = await store.reserve(key, ReserveRequest(blocks=(new,)))
    assert dict(reservation.seen) == {} and dict(reservation.previous_hash_for_id) == {"doc": old[1]}
    await store.commit(key, reservation.reservation_id, record((new,)))
    state = await store.load(key)
    assert state.ids == {"doc": new[1]} and set(state.seen) == {old[1], new[1]}
    again = await store.reserve(key, ReserveRequest(blocks=(old,)))
    assert again.seen[old[1]].turn == 1 and again.previous_hash_for_id["doc"] == new[1]


async def test_same_text_under_another_id(store: Awaiting) -> None:
    key = conversation()
    digest = content_hash("same text")
    await commit_turn(store, key, (("first-id", digest),))
    reservation = await store.reserve(key, ReserveRequest(blocks=(("second-id", digest),)))
    assert reservation.seen[digest].block_id == "first-id" and dict(reservation.previous_hash_for_id) == {}


async def test_delete_forgets_everything(store: Awaiting) -> None:
    key = conversation()
    await commit_turn(store, key, blocks("x"))
    pending = await store.reserve(key, ReserveRequest(blocks=blocks("x")))
    await store.delete(key)
    assert await store.load(key) == await store.load(conversation())
    with pytest.raises(UnknownReservationError):
        await store.commit(key, pending.reservation_id, record(blocks("x")))
    await store.delete(key)  # idempotent


async def test_two_clients_share_state(backend: Any, store: Awaiting) -> None:
    if backend.name == "memory":
        pytest.skip("the in-memory store lives in one process: a second client is the same object")
    other = store.another()
    key = conversation()
    pairs = blocks("from worker one")
    reservation = await store.reserve(key, ReserveRequest(blocks=pairs))
    assert await other.commit(key, reservation.reservation_id, record(pairs)) == 1
    assert set((await other.reserve(key, ReserveRequest(blocks=pairs))).seen) == {pairs[0][1]}
    await other.aclose()


# -- bounded transcript, windowed reads (cpmemory/stores/base.py, "Bounded transcript") -----------------------------


def trimmed_record(pairs: tuple[tuple[str, str], ...], text: str, trim_before: int = 0) -> TurnRecord:
    messages = ({"role": "user", "content": text}, {"role": "assistant", "content": f"answer to {text}"})
    return TurnRecord(messages=messages, shown=shown(pairs), search_path=(len(text),), trim_before=trim_before)


async def commit_trimmed(store: Awaiting, key: ConversationKey, pairs: tuple[tuple[str, str], ...], text: str,
                         trim_before: int = 0) -> int:
    reservation = await store.reserve(key, ReserveRequest(blocks=pairs))
    return await store.commit(key, reservation.reservation_id, trimmed_record(pairs, text, trim_before))


async def test_reserve_returns_only_the_turn_window(store: Awaiting) -> None:
    key = conversation()
    for turn in range(1, 6):
        await commit_trimmed(store, key, blocks(f"text {turn}", prefix=f"t{turn}"), f"q{turn}")
    windowed = await store.reserve(key, ReserveRequest(blocks=(), history_turns=2))
    assert windowed.transcript_start == 4 and windowed.turn_sizes == (2,)  # window_start(5, 2) == 4
    assert [m["content"] for m in windowed.transcript] == ["q5", "answer to q5"]
    everything = await store.reserve(key, ReserveRequest(blocks=()))
    assert everything.transcript_start == 0 and everything.turn_sizes == (2,) * 5
    assert [m["content"] for m in everything.transcript][::2] == [f"q{turn}" for turn in range(1, 6)]


async def test_cap_trims_oldest_turns_with_their_seen_entries(make_store: Callable[..., Awaiting]) -> None:
    store = make_store(max_transcript_turns=3)
    try:
        key = conversation()
        shared = blocks("shown in turn 1 and again in turn 4", prefix="shared")
        for turn in range(1, 6):
            pairs = blocks(f"only in turn {turn}", prefix=f"t{turn}") + (shared if turn in (1, 4) else ())
            assert await commit_trimmed(store, key, pairs, f"q{turn}") == turn
        state = await store.load(key)
        assert state.turns == 5 and len(state.search_paths) == 3
        assert [m["content"] for m in state.transcript][::2] == ["q3", "q4", "q5"]
        kept = {content_hash(f"only in turn {turn}") for turn in (3, 4, 5)} | {shared[0][1]}
        assert set(state.seen) == kept and state.seen[shared[0][1]].turn == 4
        assert set(state.ids) == {"t3-0", "t4-0", "t5-0", "shared-0"}
        request = blocks("only in turn 1", prefix="t1") + blocks("only in turn 3", prefix="t3") + shared
        reservation = await store.reserve(key, ReserveRequest(blocks=request))
        assert reservation.transcript_start == 2 and reservation.turn_sizes == (2, 2, 2)
        assert set(reservation.seen) == {content_hash("only in turn 3"), shared[0][1]}
        assert dict(reservation.previous_hash_for_id) == {"t3-0": content_hash("only in turn 3"),
                                                           "shared-0": shared[0][1]}
    finally:
        await store.aclose()


async def test_trim_before_drops_turns_the_caller_no_longer_needs(store: Awaiting) -> None:
    key = conversation()
    for turn in range(1, 4):
        await commit_trimmed(store, key, blocks(f"turn {turn} text", prefix=f"t{turn}"), f"q{turn}")
    assert await commit_trimmed(store, key, blocks("turn 4 text", prefix="t4"), "q4", trim_before=3) == 4
    state = await store.load(key)
    assert [m["content"] for m in state.transcript] == ["q4", "answer to q4"]
    assert set(state.seen) == {content_hash("turn 4 text")} and set(state.ids) == {"t4-0"}
    reservation = await store.reserve(key, ReserveRequest(blocks=blocks("turn 2 text", prefix="t2")))
    assert reservation.transcript_start == 3 and reservation.seen == {} and reservation.turn == 4
    # trim_before never drops the turn being committed, and a smaller value later trims nothing more
    assert await commit_trimmed(store, key, (), "q5", trim_before=99) == 5
    assert await commit_trimmed(store, key, (), "q6", trim_before=1) == 6
    assert [m["content"] for m in (await store.load(key)).transcript][::2] == ["q5", "q6"]


async def test_double_commit_after_trim_records_nothing_twice(make_store: Callable[..., Awaiting]) -> None:
    store = make_store(max_transcript_turns=2)
    try:
        key = conversation()
        for turn in range(1, 4):
            await commit_trimmed(store, key, blocks(f"x{turn}"), f"q{turn}")
        reservation = await store.reserve(key, ReserveRequest(blocks=()))
        first = await store.commit(key, reservation.reservation_id, trimmed_record((), "q4"))
        again = await store.commit(key, reservation.reservation_id, trimmed_record((), "q4"))
        state = await store.load(key)
        assert first == again == 4 and [m["content"] for m in state.transcript][::2] == ["q3", "q4"]
    finally:
        await store.aclose()
