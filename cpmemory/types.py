"""Value types shared by every layer (below ``core``, ``stores`` and ``session``; imports only ``errors``).

* ``Status``: what happened to a block or a framework result in a turn (the one spelling of the statuses; a ``str``
  enum, so JSON, metrics labels and comparisons with the plain strings are unchanged). ``BlockStatus`` /
  ``BLOCK_STATUSES``: the five a de-duplication decision can take.
* ``BatchPlan``: an offline plan for a batch of requests (the planner's and the facade's result).
* The session store's values: ``ConversationKey``, ``SeenBlock``, ``ReserveRequest``, ``Reservation``,
  ``TurnRecord``, ``ConversationState`` and ``Message`` (the protocol itself is ``cpmemory.stores.base``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol

from cpmemory.errors import InvalidIdentifierError


class Status(str, Enum):
    """What happened to one block (or one framework result) in a turn. Members are their wire strings:
    ``Status.NEW == "new"``, ``str(Status.NEW) == "new"``, and JSON writes ``"new"``."""

    NEW = "new"
    """Not seen in this conversation before: written in full under its header."""
    REFERENCED = "referenced"
    """Same content as a block the conversation (or this request) already holds: named by its label only."""
    CHANGED = "changed"
    """An id seen before with another text: written in full."""
    PARTIAL = "partial"
    """Enough of its segments are held earlier: only the new segments are written, the rest named by label."""
    RESENT = "resent"
    """Seen before but no longer in the prompt's history (history window): written in full again."""
    PASSTHROUGH = "passthrough"
    """An adapter result that did not go through cpmemory (no conversation id): sent in full, original order."""
    EMPTY = "empty"
    """An adapter result with empty (or whitespace-only) text: kept in the results, nothing to send."""
    DUPLICATE = "duplicate"
    """An adapter result repeating an earlier one (same id, same text): its text reaches the prompt via the first."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:  # f"{Status.NEW}" == "new" on every Python version
        return self.value.__format__(format_spec)


BlockStatus = Literal[Status.NEW, Status.REFERENCED, Status.CHANGED, Status.PARTIAL, Status.RESENT]
"""What de-duplication did with one block (see ``cpmemory.core.dedup`` for the rules)."""

BLOCK_STATUSES: tuple[BlockStatus, ...] = (Status.NEW, Status.REFERENCED, Status.CHANGED, Status.PARTIAL, Status.RESENT)
"""Every ``BlockStatus``, in rule order."""

FULL_TEXT_STATUSES: frozenset[Status] = frozenset({Status.NEW, Status.CHANGED, Status.RESENT})
"""Statuses whose block is written in full under its header."""

MAX_IDENTIFIER_CHARS = 1024

Message = Mapping[str, str]  # {"role": ..., "content": ...}


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """An execution plan for a batch of requests.

    Attributes:
        order: execution order, as indices into the input requests.
        contexts: each request's blocks (block ids for the facade, any hashable for ``core.planner``) in their
            planned prompt order; ``contexts[i]`` is a permutation of input ``i``, indexed like the input.
        request_ids: the index leaf of each request ("" for an empty request); empty when nothing was indexed.
    """

    order: list[int]
    contexts: list[list[Any]]
    request_ids: list[str] = field(default_factory=list)


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
    """What ``reserve`` needs: the request's blocks as (block_id, content_hash) pairs, in request order.

    ``order_sizes`` (one size per block): a store holding the tenant's shared decision state (Redis) also returns
    the online order of the request's distinct hashes in ``Reservation.shared_order`` (a :class:`SharedOrder`: asked
    for the blocks the prompt shows once dedup has run), in the same round trip.
    ``match_prefix``: whether that order may follow a recorded order's prefix (the match); False for a request
    whose prompt opens with earlier turns (a later turn): no other request's cached prefix reaches its blocks, so
    the order is the co-occurrence extension alone and the shared state skips the match walk.

    ``history_turns`` (with ``include_transcript``): return only the turn window of ``max_history_turns`` = N turns
    (the turns after ``cpmemory.session.turns.window_start(turns, N)``); None returns every stored turn.
    """

    blocks: tuple[tuple[str, str], ...]
    reservation_timeout_s: float = 120.0
    include_transcript: bool = True
    history_turns: int | None = None
    order_sizes: tuple[float, ...] | None = None
    match_prefix: bool = True


@dataclass(frozen=True, slots=True)
class Reservation:
    """What ``reserve`` returns: the committed state relevant to this request, and the reservation id.

    ``seen`` and ``previous_hash_for_id`` are restricted to the hashes / ids of the request.
    ``transcript`` is None when not requested; it holds the committed turns after ``transcript_start`` (turns
    trimmed from the store, or outside the requested turn window, are not returned), and ``turn_sizes`` gives the
    number of messages of each of those turns (empty: unknown, a user message starts each turn).
    """

    reservation_id: str
    turn: int
    seen: Mapping[str, SeenBlock]
    previous_hash_for_id: Mapping[str, str]
    transcript: tuple[Message, ...] | None = None
    last_search_path: tuple[int, ...] = ()
    transcript_start: int = 0
    turn_sizes: tuple[int, ...] = ()
    shared_order: SharedOrder | None = None


class SharedOrder(Protocol):
    """The order the tenant's shared decision state gave one request (``Reservation.shared_order``)."""

    def order(self, keys: Sequence[str]) -> list[str]:
        """``keys`` (distinct content hashes of the request, relevance order) in the order to send them. Pure."""
        ...


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """What ``commit`` makes durable.

    ``trim_before``: the committed turns up to this number are no longer needed by the caller (they left its history
    window); the store drops them, with the seen entries that point into them, in the same atomic step.
    ``sent_order`` / ``request_id``: the content hashes shown in full, in prompt order, and the index request id;
    a store holding the tenant's shared decision state records them in the same round trip.
    """

    messages: tuple[Message, ...]
    shown: tuple[SeenBlock, ...]
    search_path: tuple[int, ...] = ()
    trim_before: int = 0
    sent_order: tuple[str, ...] = ()
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class ConversationState:
    """A full read of one conversation (for inspection, tests and tools; not on the hot path).

    ``transcript`` and ``search_paths`` hold the turns still stored: the last ``len(search_paths)`` committed turns
    (older ones were trimmed, see ``TurnRecord.trim_before`` and the stores' ``max_transcript_turns``).
    """

    turns: int = 0
    seen: Mapping[str, SeenBlock] = field(default_factory=dict)
    ids: Mapping[str, str] = field(default_factory=dict)
    transcript: tuple[Message, ...] = ()
    search_paths: tuple[tuple[int, ...], ...] = ()
    open_reservations: int = 0
