"""The SessionStore seam: per-conversation state behind a two-phase turn.

State of one conversation (tenant + conversation id):
  * ``turns``        number of committed turns;
  * ``seen``         content_hash -> SeenBlock (where the block's full text sits in the transcript);
  * ``ids``          block_id -> content_hash last committed under that id (detects *changed* blocks);
  * ``transcript``   committed chat messages (user turn with its context, assistant answer), in commit order;
  * ``search_paths`` the index search path of each committed turn (used for routing affinity);
  * ``reservations`` open reservations (prepared, not yet committed or aborted), each with a deadline.

Contract (every implementation passes tests/stores/test_contract.py):
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
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from cpmemory.errors import InvalidIdentifierError

MAX_IDENTIFIER_CHARS = 1024

Message = Mapping[str, str]  # {"role": ..., "content": ...}


def _check_identifier(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidIdentifierError(f"{kind} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidIdentifierError(f"{kind} must not be empty")
    if len(value) > MAX_IDENTIFIER_CHARS:
        raise InvalidIdentifierError(f"{kind} is longer than {MAX_IDENTIFIER_CHARS} characters")
    return value


@dataclass(frozen=True, slots=True)
class ConversationKey:
    """Names one conversation of one tenant. Any non-empty string up to 1,024 characters is allowed for both;
    stores map them to safe keys themselves."""

    tenant: str
    conversation: str

    def __post_init__(self) -> None:
        _check_identifier("tenant", self.tenant)
        _check_identifier("conversation id", self.conversation)


@dataclass(frozen=True, slots=True)
class SeenBlock:
    """A block whose full text was shown in committed turn ``turn`` under ``label``."""

    block_id: str
    content_hash: str
    label: str
    turn: int


@dataclass(frozen=True, slots=True)
class ReserveRequest:
    """What ``reserve`` needs: the request's blocks as (block_id, content_hash) pairs, in request order."""

    blocks: tuple[tuple[str, str], ...]
    reservation_timeout_s: float = 120.0
    include_transcript: bool = True


@dataclass(frozen=True, slots=True)
class Reservation:
    """What ``reserve`` returns: the committed state relevant to this request, and the reservation id.

    ``seen`` and ``previous_hash_for_id`` are restricted to the hashes / ids of the request.
    ``transcript`` is None when not requested.
    """

    reservation_id: str
    turn: int
    seen: Mapping[str, SeenBlock]
    previous_hash_for_id: Mapping[str, str]
    transcript: tuple[Message, ...] | None = None
    last_search_path: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """What ``commit`` makes durable."""

    messages: tuple[Message, ...]
    shown: tuple[SeenBlock, ...]
    search_path: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ConversationState:
    """A full read of one conversation (for inspection, tests and tools; not on the hot path)."""

    turns: int = 0
    seen: Mapping[str, SeenBlock] = field(default_factory=dict)
    ids: Mapping[str, str] = field(default_factory=dict)
    transcript: tuple[Message, ...] = ()
    search_paths: tuple[tuple[int, ...], ...] = ()
    open_reservations: int = 0


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
