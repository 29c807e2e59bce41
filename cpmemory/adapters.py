"""Public toolkit for framework adapters (``langchain-cpmemory``, ``mem0-cpmemory`` and any third-party one).

This module and the names exported by ``cpmemory`` are the whole API an adapter may use; an adapter never imports
``cpmemory.core``, ``cpmemory.session`` or other internals (an import-linter contract checks ours).

Everything here is sans-IO: it never calls the facade itself, so the sync and async adapters share it. An adapter

1. turns the framework's results into blocks (``Block``), in the framework's relevance order;
2. calls ``CpMemory.prepare`` / ``AsyncCpMemory.prepare`` (the only IO step);
3. hands the framework's own objects back in *prompt order*, each carrying :func:`decision_fields`;
4. keeps the prepared turn in :class:`PendingTurns` until the caller commits the answer or aborts (bounded: the
   oldest conversations' turns are handed back to be aborted, and counted).

Every value an adapter writes into a framework's objects is plain JSON (statuses are ``str``, not
:class:`cpmemory.types.Status`), so checkpointers that refuse unknown types (LangGraph's strict msgpack) keep them.

Fallback shared by every adapter: when no conversation id is known, the results are passed through in their
original order, nothing is de-duplicated, and :func:`passthrough_messages` shows every block in full.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cpmemory.core.annotations import build_user_message, format_block
from cpmemory.core.blocks import Block, content_hash, resolve_blocks
from cpmemory.types import FULL_TEXT_STATUSES, Status

STATUS_PASSTHROUGH = Status.PASSTHROUGH
"""Status of a result that did not go through cpmemory (no conversation id); it is sent in full."""

STATUS_EMPTY = Status.EMPTY
"""Status of a result with empty (or whitespace-only) text: kept in the results, nothing to send."""

STATUS_DUPLICATE = Status.DUPLICATE
"""Status of a result repeating an earlier one (same id, same text): its text reaches the prompt via the first."""

DERIVED_ID_PREFIX = "hash:"
"""Prefix of the block id derived for a result that has no id of its own."""

FULL_STATUSES = FULL_TEXT_STATUSES | {STATUS_PASSTHROUGH}
"""Statuses whose block text is sent in full in this turn's prompt."""

DEFAULT_PENDING_LIMIT = 10_000
"""Pending turns an adapter keeps when its facade does not say (``CpMemoryConfig.max_pending_turns``'s default)."""


def plain_status(status: Any) -> str:
    """``status`` as a plain ``str`` (a :class:`~cpmemory.types.Status` member's value), for framework objects."""
    return str(status.value) if isinstance(status, Status) else str(status)


def pending_limit(memory: Any) -> int:
    """How many pending turns an adapter over ``memory`` keeps: the facade's ``max_pending_turns`` (it forgets
    older prepared turns past that bound itself), else :data:`DEFAULT_PENDING_LIMIT`."""
    limit = getattr(getattr(memory, "config", None), "max_pending_turns", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 else DEFAULT_PENDING_LIMIT


class PassthroughWarning(UserWarning):
    """Warned when an adapter passes results through because the call names no conversation."""


class DecisionLike(Protocol):
    """What the adapters read from a ``cpmemory.facade.BlockDecision``."""

    block_id: str
    label: str
    status: str
    original_rank: int
    prompt_position: int | None


class PreparedTurnLike(Protocol):
    """What the adapters read from a ``cpmemory.facade.PreparedTurn``."""

    reservation_id: str
    conversation_id: str
    turn: int
    messages: Sequence[Mapping[str, str]]
    decisions: Sequence[DecisionLike]
    degraded: bool


@dataclass(frozen=True, slots=True)
class BlockAssignment:
    """Blocks made from a framework's results, and where each result went.

    Attributes:
        blocks: the blocks to send to cpmemory, in relevance order (ids unique).
        item_block: for each result, the index of its block in ``blocks``, or None when it is not sent.
        notes: for each result, extra ``cpmemory`` fields (``id_derived``, ``id_collision``, ``status`` for
            ``empty`` / ``duplicate`` results, ``duplicate_of``).
    """

    blocks: tuple[Block, ...]
    item_block: tuple[int | None, ...]
    notes: tuple[Mapping[str, Any], ...]


def assign_blocks(entries: Sequence[tuple[str | None, str, str | None]]) -> BlockAssignment:
    """Make blocks from ``(id or None, text, content hash hint or None)`` entries in relevance order. Pure; O(n).

    Rules (no result is ever dropped silently); repeated ids follow cpmemory's one rule
    (:func:`cpmemory.core.blocks.resolve_blocks`):
      * no id -> ``"hash:<hint or content hash of the text>"``, noted ``id_derived``;
      * empty / whitespace-only text -> not sent, noted ``status="empty"``;
      * an id seen before with the same text -> not sent, noted ``status="duplicate"``, ``duplicate_of=<rank>``;
      * an id seen before with another text -> sent under a free id ``"<id>#<hex>"``, noted ``id_collision``.
    """
    notes: list[dict[str, Any]] = [{} for _ in entries]
    candidates: list[tuple[int, Block]] = []
    for rank, (raw_id, text, hint) in enumerate(entries):
        block_id = raw_id
        if not block_id:
            block_id, notes[rank]["id_derived"] = DERIVED_ID_PREFIX + (hint or content_hash(text)), True
        if not text.strip():
            notes[rank]["status"] = plain_status(STATUS_EMPTY)
        else:
            candidates.append((rank, Block(block_id, text, {"rank": rank})))
    resolved = resolve_blocks([block for _, block in candidates])
    item_block: list[int | None] = [None] * len(entries)
    first_rank: dict[int, int] = {}
    for (rank, block), index in zip(candidates, resolved.item_block):
        if index in first_rank:
            notes[rank].update(status=plain_status(STATUS_DUPLICATE), duplicate_of=first_rank[index])
            continue
        first_rank[index] = rank
        item_block[rank] = index
        if resolved.blocks[index].id != block.id:
            notes[rank]["id_collision"] = True
    return BlockAssignment(resolved.blocks, tuple(item_block), tuple(notes))


def decision_fields(turn: PreparedTurnLike, decision: DecisionLike) -> dict[str, Any]:
    """Return the ``cpmemory`` field attached to one result: what cpmemory decided for it. Pure."""
    return {
        "status": plain_status(decision.status),
        "label": decision.label,
        "original_rank": decision.original_rank,
        "prompt_position": decision.prompt_position,
        "conversation_id": turn.conversation_id,
        "turn": turn.turn,
        "reservation_id": turn.reservation_id,
        "degraded": turn.degraded,
        "saved_chars": getattr(decision, "saved_chars", 0),
    }


def passthrough_fields(original_rank: int, reason: str) -> dict[str, Any]:
    """Return the ``cpmemory`` field of a result passed through untouched (sent in full, original order)."""
    return {
        "status": plain_status(STATUS_PASSTHROUGH),
        "label": None,
        "original_rank": original_rank,
        "prompt_position": original_rank,
        "conversation_id": None,
        "turn": None,
        "reservation_id": None,
        "degraded": False,
        "saved_chars": 0,
        "reason": reason,
    }


def prompt_ranks(decisions: Sequence[DecisionLike]) -> list[int]:
    """Return the original ranks of ``decisions`` in the order the results should be handed back.

    Blocks placed in the prompt (``prompt_position`` set) come first, in prompt order; blocks without a position
    (references) follow in relevance order. Pure; O(n log n).
    """

    def key(decision: DecisionLike) -> tuple[bool, int, int]:
        position = decision.prompt_position
        return (position is None, position if position is not None else 0, decision.original_rank)

    return [decision.original_rank for decision in sorted(decisions, key=key)]


def passthrough_messages(
    query: str,
    blocks: Sequence[Block],
    *,
    history: Sequence[Mapping[str, str]] | None = None,
    system_prompt: str | None = None,
) -> list[dict[str, str]]:
    """Return chat messages showing every block in full, in the given order (the no-conversation fallback).

    The user message uses the same layout as cpmemory's own prompts (labelled blocks, then the question), so a
    model sees one format whether or not a conversation id was given. Pure.
    """
    messages: list[dict[str, str]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.extend(dict(message) for message in history or ())  # every field, as given
    shown = [format_block(block.label, block.text) for block in blocks]
    messages.append({"role": "user", "content": build_user_message(shown, [], None, query)})
    return messages


def online_order(memory: Any, blocks: Sequence[Block], tenant: str) -> list[Block]:
    """``blocks`` in the facade's online order for a request without a conversation (no dedup, no state); the
    given order when the facade has no online orderer."""
    order_blocks = getattr(memory, "order_blocks", None)
    if order_blocks is None or not blocks:
        return list(blocks)
    return list(order_blocks(list(blocks), tenant=tenant))


def facade_system_prompt(memory: Any, override: str | None) -> str | None:
    """The system prompt a facade would use: ``override``, else its configured one (pass-through prompts match)."""
    if override is not None:
        return override
    return getattr(getattr(memory, "config", None), "system_prompt", None)


class PendingTurns:
    """Prepared turns not yet committed or aborted, one per conversation, at most ``limit`` of them. Thread-safe.

    A conversation has at most one turn in flight through an adapter: preparing a new turn displaces the previous
    one. Conversations that never commit must not pile up, so past ``limit`` conversations the oldest pending turn
    is displaced too (counted in :attr:`evicted`). :meth:`put` returns every displaced turn for the adapter to
    abort (an aborted turn records nothing, so later turns never refer to text that was not committed).

    Args:
        limit: the most pending turns kept (see :func:`pending_limit`).

    Raises:
        ValueError: ``limit`` is below 1.
    """

    __slots__ = ("_evicted", "_limit", "_lock", "_turns")

    def __init__(self, limit: int = DEFAULT_PENDING_LIMIT) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"PendingTurns limit must be an integer >= 1, got {limit!r}")
        self._lock = threading.Lock()
        self._turns: OrderedDict[str, Any] = OrderedDict()
        self._limit = limit
        self._evicted = 0

    @property
    def limit(self) -> int:
        """The most pending turns kept."""
        return self._limit

    @property
    def evicted(self) -> int:
        """Pending turns displaced because ``limit`` conversations were pending (oldest first), since creation."""
        with self._lock:
            return self._evicted

    def put(self, conversation_id: str, turn: Any) -> list[Any]:
        """Record ``turn`` as the conversation's pending turn. Mutates; amortised O(1).

        Returns:
            The turns displaced, for the caller to abort: the conversation's previous pending turn (if any), then
            the oldest other conversations' turns over ``limit``.
        """
        with self._lock:
            displaced = []
            previous = self._turns.pop(conversation_id, None)
            if previous is not None:
                displaced.append(previous)
            self._turns[conversation_id] = turn
            while len(self._turns) > self._limit:
                displaced.append(self._turns.popitem(last=False)[1])
                self._evicted += 1
            return displaced

    def get(self, conversation_id: str) -> Any | None:
        """Return the conversation's pending turn, or None. Does not remove it. O(1)."""
        with self._lock:
            return self._turns.get(conversation_id)

    def pop(self, conversation_id: str) -> Any | None:
        """Remove and return the conversation's pending turn, or None. O(1)."""
        with self._lock:
            return self._turns.pop(conversation_id, None)

    def discard(self, conversation_id: str, turn: Any) -> bool:
        """Remove the conversation's pending turn only if it is ``turn``; return whether it was removed."""
        with self._lock:
            if self._turns.get(conversation_id) is turn:
                del self._turns[conversation_id]
                return True
            return False

    def __len__(self) -> int:
        with self._lock:
            return len(self._turns)
