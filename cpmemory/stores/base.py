"""The SessionStore seam: per-conversation state behind a two-phase turn (its value types: ``cpmemory.types``).

State of one conversation (tenant + conversation id):
  * ``turns``        number of committed turns;
  * ``seen``         content_hash -> SeenBlock (where the block's full text sits in the transcript);
  * ``ids``          block_id -> content_hash last committed under that id (detects *changed* blocks);
  * ``transcript``   committed chat messages (user turn with its context, assistant answer), in commit order, kept
                     per turn for the last ``max_transcript_turns`` turns at most (see "Bounded transcript");
  * ``search_paths`` the index search path of each stored turn (used for routing affinity);
  * ``reservations`` open reservations (prepared, not yet committed or aborted), each with a deadline.

Contract (every implementation passes tests/contract/test_store_contract.py):
  * ``reserve`` is one atomic step (one Redis round trip): it reads what is committed and records a reservation.
    Only *committed* state is returned; a concurrent reservation's blocks are never visible to another.
  * ``commit`` is one atomic step: it appends the record, bumps ``turns``, removes the reservation, and returns the
    committed turn number. Committing the same reservation twice returns the same number and records nothing twice.
    Committing an unknown reservation raises UnknownReservationError; one past its deadline raises
    ReservationExpiredError (and records nothing).
  * ``abort`` releases a reservation; unknown ids return False (idempotent).
  * Every call refreshes the conversation's TTL; an expired conversation reads as empty, never as an error.
  * Tenants are isolated: no call with one tenant can read or change another tenant's state.
  * A store that cannot reach its backend raises StoreUnavailableError (the facade degrades to pass-through).

Bounded transcript (flat reads):
  * ``reserve`` returns only the stored turns after ``max(trimmed turns, window_start(turns, history_turns))``
    (``Reservation.transcript_start``), with the message count of each (``turn_sizes``): O(window) bytes.
  * ``commit`` drops, in the same atomic step, the oldest turns beyond ``max_transcript_turns`` and every turn up to
    ``TurnRecord.trim_before``, together with the seen entries last shown in a dropped turn and the id entries whose
    (id, text) no stored turn shows any more: a block whose text left the store is never referenced again, it is
    resent.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from cpmemory.types import (
    MAX_IDENTIFIER_CHARS,
    ConversationKey,
    ConversationState,
    Message,
    Reservation,
    ReserveRequest,
    SeenBlock,
    TurnRecord,
)

DEFAULT_MAX_TRANSCRIPT_TURNS = 1000
"""Default cap on the turns a store keeps per conversation (oldest trimmed first)."""
FINISHED_MARKERS_KEPT = 256
"""Committed and expired reservation ids each store remembers per conversation (a repeated commit of an id
forgotten since raises UnknownReservationError); stores/lua/common.lua's DONE_KEEP is the same number."""


def history_window_start(turns: int, history_turns: int | None) -> int:
    """The turn window of ``max_history_turns``: committed turns left out (``cpmemory.session.turns.window_start``).

    The Lua reserve script computes the same. Pure; O(1).
    """
    if history_turns is None or history_turns <= 0 or turns <= history_turns:
        return 0
    return (turns - 1) // history_turns * history_turns


__all__ = [
    "DEFAULT_MAX_TRANSCRIPT_TURNS",
    "MAX_IDENTIFIER_CHARS",
    "AsyncSessionStore",
    "ConversationKey",
    "ConversationState",
    "Message",
    "Reservation",
    "ReserveRequest",
    "SeenBlock",
    "SessionStore",
    "TurnRecord",
    "history_window_start",
]


@runtime_checkable
class SessionStore(Protocol):
    """Synchronous session store."""

    def reserve(self, key: ConversationKey, request: ReserveRequest) -> Reservation: ...

    def commit(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> int: ...

    def abort(self, key: ConversationKey, reservation_id: str) -> bool: ...

    def load(self, key: ConversationKey) -> ConversationState: ...

    def delete(self, key: ConversationKey) -> None: ...


@runtime_checkable
class AsyncSessionStore(Protocol):
    """Asyncio session store: the same contract, awaited."""

    async def reserve(self, key: ConversationKey, request: ReserveRequest) -> Reservation: ...

    async def commit(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> int: ...

    async def abort(self, key: ConversationKey, reservation_id: str) -> bool: ...

    async def load(self, key: ConversationKey) -> ConversationState: ...

    async def delete(self, key: ConversationKey) -> None: ...
