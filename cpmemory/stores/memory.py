"""In-memory session stores: the embedded default (one process), same contract as the Redis store.

``InMemorySessionStore`` keeps every conversation in a dict behind one lock; each call is one critical section, so
reserve and commit are atomic exactly like the Redis scripts. ``AsyncInMemorySessionStore`` wraps it (the critical
sections are short and never wait on IO, so the event loop is not blocked in any meaningful way).

Time comes from an injectable monotonic clock (tests move it by hand). Expired conversations are dropped lazily
when touched and by a sweep every ``SWEEP_EVERY`` calls, so memory stays bounded by the live conversations.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from cpmemory.errors import InvalidInputError, ReservationExpiredError, UnknownReservationError
from cpmemory.stores.base import (
    DEFAULT_MAX_TRANSCRIPT_TURNS,
    FINISHED_MARKERS_KEPT,
    ConversationKey,
    ConversationState,
    Message,
    Reservation,
    ReserveRequest,
    SeenBlock,
    TurnRecord,
    history_window_start,
)

SWEEP_EVERY = 1024
MAX_FINISHED_MARKERS = FINISHED_MARKERS_KEPT  # committed + expired ids remembered, as the Redis store (DONE_KEEP)

Clock = Callable[[], float]


@dataclass(slots=True)
class _Conversation:
    """Mutable state of one conversation (only touched under the store lock)."""

    expires_at: float
    turns: int = 0
    seen: dict[str, SeenBlock] = field(default_factory=dict)
    ids: dict[str, str] = field(default_factory=dict)
    transcript: list[tuple[Message, ...]] = field(default_factory=list)  # per stored turn
    shown: list[tuple[tuple[str, str], ...]] = field(default_factory=list)  # per stored turn: (hash, id) shown
    search_paths: list[tuple[int, ...]] = field(default_factory=list)  # per stored turn
    reservations: dict[str, float] = field(default_factory=dict)  # id -> deadline
    committed: OrderedDict[str, int] = field(default_factory=OrderedDict)  # id -> turn (double commit)
    expired: OrderedDict[str, int] = field(default_factory=OrderedDict)  # ids that timed out -> turns then

    def purge_reservations(self, now: float) -> None:
        for reservation_id, deadline in list(self.reservations.items()):
            if deadline < now:
                del self.reservations[reservation_id]
                _remember(self, self.expired, reservation_id)

    def finished(self) -> int:
        return len(self.committed) + len(self.expired)


def _remember(conversation: _Conversation, markers: OrderedDict, key: str, turn: int | None = None) -> None:
    """Remember a committed (its turn) or expired (the turns then) id; beyond MAX_FINISHED_MARKERS in all, forget
    the one with the lowest turn, a committed id first on a tie: what the Redis store's sorted set does."""
    markers[key] = conversation.turns if turn is None else turn
    committed, expired = conversation.committed, conversation.expired
    while conversation.finished() > MAX_FINISHED_MARKERS:
        oldest_commit = next(iter(committed.values())) if committed else None
        oldest_expiry = next(iter(expired.values())) if expired else None
        if oldest_expiry is None or (oldest_commit is not None and oldest_commit <= oldest_expiry):
            committed.popitem(last=False)
        else:
            expired.popitem(last=False)


class InMemorySessionStore:
    """Thread-safe in-memory SessionStore (see cpmemory.stores.base for the contract).

    Args:
        ttl_s: seconds a conversation lives after its last use; None keeps it forever.
        clock: monotonic time source in seconds (injectable for tests).
        max_transcript_turns: turns kept per conversation; older ones are trimmed at commit, with the seen entries
            pointing into them (see cpmemory.stores.base, "Bounded transcript").
    """

    def __init__(
        self,
        ttl_s: float | None = 24 * 3600.0,
        clock: Clock = time.monotonic,
        *,
        max_transcript_turns: int = DEFAULT_MAX_TRANSCRIPT_TURNS,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidInputError(f"ttl_s must be positive or None, got {ttl_s!r}")
        if isinstance(max_transcript_turns, bool) or not isinstance(max_transcript_turns, int) or max_transcript_turns < 1:
            raise InvalidInputError(f"max_transcript_turns must be a positive int, got {max_transcript_turns!r}")
        self._max_turns = max_transcript_turns
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._conversations: dict[ConversationKey, _Conversation] = {}
        self._calls = 0

    def __len__(self) -> int:
        """Number of live conversations (expired ones may linger until the next sweep)."""
        return len(self._conversations)

    def _deadline(self, now: float) -> float:
        return float("inf") if self._ttl_s is None else now + self._ttl_s

    def _get(self, key: ConversationKey, now: float, create: bool) -> _Conversation | None:
        """Return the live conversation (refreshing its TTL), creating it when asked. Call under the lock."""
        self._calls += 1
        if self._calls % SWEEP_EVERY == 0:
            self._sweep(now)
        conversation = self._conversations.get(key)
        if conversation is not None and conversation.expires_at < now:
            del self._conversations[key]
            conversation = None
        if conversation is None and create:
            conversation = self._conversations[key] = _Conversation(expires_at=now)
        if conversation is not None:
            conversation.expires_at = self._deadline(now)
            conversation.purge_reservations(now)
        return conversation

    def _sweep(self, now: float) -> None:
        for key in [key for key, state in self._conversations.items() if state.expires_at < now]:
            del self._conversations[key]

    def reserve(self, key: ConversationKey, request: ReserveRequest) -> Reservation:
        """Read the committed state this request needs and record a reservation, atomically. O(k + window)."""
        reservation_id = uuid.uuid4().hex
        with self._lock:
            now = self._clock()
            conversation = self._get(key, now, create=True)
            assert conversation is not None
            conversation.reservations[reservation_id] = now + request.reservation_timeout_s
            seen = {h: conversation.seen[h] for _, h in request.blocks if h in conversation.seen}
            previous = {i: conversation.ids[i] for i, _ in request.blocks if i in conversation.ids}
            last_path = conversation.search_paths[-1] if conversation.search_paths else ()
            if not request.include_transcript:
                return Reservation(reservation_id, conversation.turns, seen, previous, None, last_path)
            base = conversation.turns - len(conversation.transcript)
            start = max(base, history_window_start(conversation.turns, request.history_turns))
            window = conversation.transcript[start - base :]
            transcript = tuple(message for turn in window for message in turn)
            sizes = tuple(len(turn) for turn in window)
            return Reservation(
                reservation_id, conversation.turns, seen, previous, transcript, last_path, start, sizes
            )

    def commit(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> int:
        """Make a reserved turn durable exactly once and return its turn number (>= 1).

        Raises:
            UnknownReservationError: the reservation was never made, was aborted, or its conversation expired.
            ReservationExpiredError: the reservation timed out before this commit (nothing is recorded).
        """
        with self._lock:
            now = self._clock()
            conversation = self._get(key, now, create=False)
            if conversation is None:
                raise UnknownReservationError(f"unknown reservation {reservation_id!r}")
            if reservation_id in conversation.committed:
                return conversation.committed[reservation_id]
            if reservation_id in conversation.expired:
                raise ReservationExpiredError(f"reservation {reservation_id!r} timed out before commit")
            if conversation.reservations.pop(reservation_id, None) is None:
                raise UnknownReservationError(f"unknown reservation {reservation_id!r}")
            return _apply(conversation, reservation_id, record, self._max_turns)

    def abort(self, key: ConversationKey, reservation_id: str) -> bool:
        """Release an open reservation; False when it is unknown (idempotent)."""
        with self._lock:
            conversation = self._get(key, self._clock(), create=False)
            if conversation is None:
                return False
            return conversation.reservations.pop(reservation_id, None) is not None

    def load(self, key: ConversationKey) -> ConversationState:
        """Return a copy of the conversation's full state (empty when unknown or expired)."""
        with self._lock:
            conversation = self._get(key, self._clock(), create=False)
            if conversation is None:
                return ConversationState()
            return ConversationState(
                turns=conversation.turns,
                seen=dict(conversation.seen),
                ids=dict(conversation.ids),
                transcript=tuple(message for turn in conversation.transcript for message in turn),
                search_paths=tuple(conversation.search_paths),
                open_reservations=len(conversation.reservations),
            )

    def delete(self, key: ConversationKey) -> None:
        """Forget the conversation (open reservations become unknown)."""
        with self._lock:
            self._conversations.pop(key, None)


def _apply(conversation: _Conversation, reservation_id: str, record: TurnRecord, max_turns: int) -> int:
    """Append ``record`` as the next turn, then trim the oldest turns. Call under the store lock."""
    conversation.turns += 1
    turn = conversation.turns
    conversation.transcript.append(tuple({"role": m["role"], "content": m["content"]} for m in record.messages))
    conversation.shown.append(tuple((shown.content_hash, shown.block_id) for shown in record.shown))
    for shown in record.shown:
        conversation.seen[shown.content_hash] = SeenBlock(
            shown.block_id, shown.content_hash, shown.label, turn
        )
        conversation.ids[shown.block_id] = shown.content_hash
    conversation.search_paths.append(tuple(record.search_path))
    _remember(conversation, conversation.committed, reservation_id, turn)
    _trim(conversation, max(turn - max_turns, min(record.trim_before, turn - 1)))
    return turn


def _trim(conversation: _Conversation, upto: int) -> None:
    """Drop the stored turns numbered up to ``upto``, the seen entries last shown in them, and the id entries whose
    (id, text) no stored turn shows any more."""
    base = conversation.turns - len(conversation.transcript)
    drop = upto - base
    if drop <= 0:
        return
    for offset in range(drop):
        dropped_turn = base + 1 + offset
        for content_hash, block_id in conversation.shown[offset]:
            seen = conversation.seen.get(content_hash)
            if seen is not None and seen.turn == dropped_turn:
                del conversation.seen[content_hash]
                seen = None
            # the id's entry goes unless a stored turn still shows this text under this id
            if conversation.ids.get(block_id) == content_hash and (seen is None or seen.block_id != block_id):
                del conversation.ids[block_id]
    del conversation.transcript[:drop], conversation.shown[:drop], conversation.search_paths[:drop]


class AsyncInMemorySessionStore:
    """Asyncio face of :class:`InMemorySessionStore` (same contract, awaited; shares the same state when given one)."""

    def __init__(
        self,
        ttl_s: float | None = 24 * 3600.0,
        clock: Clock = time.monotonic,
        *,
        store: InMemorySessionStore | None = None,
        max_transcript_turns: int = DEFAULT_MAX_TRANSCRIPT_TURNS,
    ) -> None:
        self.sync = (
            store
            if store is not None
            else InMemorySessionStore(ttl_s=ttl_s, clock=clock, max_transcript_turns=max_transcript_turns)
        )

    async def reserve(self, key: ConversationKey, request: ReserveRequest) -> Reservation:
        """See :meth:`InMemorySessionStore.reserve`."""
        return self.sync.reserve(key, request)

    async def commit(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> int:
        """See :meth:`InMemorySessionStore.commit`."""
        return self.sync.commit(key, reservation_id, record)

    async def abort(self, key: ConversationKey, reservation_id: str) -> bool:
        """See :meth:`InMemorySessionStore.abort`."""
        return self.sync.abort(key, reservation_id)

    async def load(self, key: ConversationKey) -> ConversationState:
        """See :meth:`InMemorySessionStore.load`."""
        return self.sync.load(key)

    async def delete(self, key: ConversationKey) -> None:
        """See :meth:`InMemorySessionStore.delete`."""
        self.sync.delete(key)
