"""The turn lifecycle as pure functions shared by the sync and async facades (they only add the store IO).

prepare = ``make_input`` (validate, normalise) -> store.reserve(``reserve_request``) -> ``plan_turn`` (dedup, index
placement, ordering, prompt) ; commit = store.commit(``commit_record``) ; a store failure -> ``degraded_turn``.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cpmemory.core import annotations
from cpmemory.core.blocks import Block
from cpmemory.core.dedup import (
    CommittedHistory,
    DedupDecision,
    GivenHistory,
    HistoryView,
    SegmentIndex,
    decide,
    label_holds_only,
    partial_overlap,
)
from cpmemory.errors import InvalidInputError
from cpmemory.session.config import CpMemoryConfig
from cpmemory.session.index import TenantIndexes
from cpmemory.session.labels import LabelContext, assign_labels
from cpmemory.session.turn_input import (
    TurnInput,
)
from cpmemory.session.window import SentHistory, sent_history, turn_offsets, window_start  # noqa: F401 - re-exported
from cpmemory.types import (
    FULL_TEXT_STATUSES,
    BlockStatus,
    ConversationKey,
    Message,
    Reservation,
    ReserveRequest,
    SeenBlock,
    Status,
    TurnRecord,
)


@dataclass(frozen=True, slots=True)
class BlockDecision:
    """What happened to one block of a prepared turn.

    Attributes:
        block_id: the caller's id (never shown to the model).
        label: the block's label in the prompt.
        status: "new", "referenced", "changed", "partial" or "resent" (see cpmemory.core.dedup).
        original_rank: position of the item in the caller's list (0 = most relevant); there is one decision per
            item, so ``decisions[rank]`` is the caller's item ``rank``.
        prompt_position: position of the block's entry among the prompt's labelled entries (blocks, then
            references); an in-request duplicate gets the position of the block it duplicates.
        content_hash: the block's content hash.
        saved_chars: characters not sent because of de-duplication.
        duplicate_of: for an item whose text an earlier item of the request already brings (same text, under the
            same id or another one): that item's rank; the item is "referenced" and shares its label and position.
            A repeated id with another text is not a duplicate: its ``block_id`` is renamed (``"<id>#<hex>"``,
            ``cpmemory.core.blocks.resolve_blocks``) and it gets its own label and decision.
    """

    block_id: str
    label: str
    status: BlockStatus
    original_rank: int
    prompt_position: int | None
    content_hash: str = ""
    saved_chars: int = 0
    duplicate_of: int | None = None


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    """A prepared (reserved, not yet committed) turn: what to send, and what was done to the blocks.

    Attributes:
        reservation_id: the store reservation ("" for a degraded turn).
        tenant: tenant of the conversation.
        conversation_id: the conversation.
        turn: the number this turn gets if it is committed next (0 for a degraded turn).
        request_id: id of this request's leaf in the tenant's context index ("" when nothing was inserted).
        messages: the chat messages to send: [{"role", "content"}, ...]; messages of a caller-given history are
            sent as given (every field: tool calls, tool call ids, names, content parts).
        decisions: one per caller item, in original rank order.
        prompt_order: ids of the blocks sent in full, in prompt order.
        search_path: the index search path of this request.
        degraded: True when the store failed and the turn is a pass-through (commit/abort are no-ops).
        order_annotated: True when the prompt carries an order annotation.
        saved_chars: characters not sent because of de-duplication.
        query: the question.
        user_message: the content of the user message as sent (what commit records, even if the caller
            mutates ``messages``).
        index_evictions: requests the tenant's index dropped to stay bounded when this one was inserted.
        dropped_turns: committed turns left out of the history sent (``CpMemoryConfig.max_history_turns``, the
            token budget's window, or trimmed from the store).
        prompt_tokens: the prompt's size under the budget's counter (0 when no budget applies).
        budget: the token budget the prompt fits (None: none).
        trim_before: committed turns the store may drop at commit (they are outside the budget's window).
        opens_conversation: only system messages come before the user message (no earlier turn): the prompt's
            block order is cached from the system prompt on, so commit records it in the tenant's shared
            decision state (a Redis store).
        history_sent: messages of history the prompt sends (between the system prompt and the user message).
        history: how the caller's history was used (``cpmemory.session.reconcile``): "matched" (planned from the
            committed transcript), "diverged" (sent as given), "none" (no history given), "unchecked".
        history_dropped: (messages, turns) of the history offered to the turn (the caller's, else the stored
            transcript) that the prompt leaves out (a token budget, the turn window).
    """

    reservation_id: str
    tenant: str
    conversation_id: str
    turn: int
    request_id: str
    messages: list[dict[str, Any]]
    decisions: list[BlockDecision]
    prompt_order: list[str]
    search_path: tuple[int, ...] = ()
    degraded: bool = False
    order_annotated: bool = False
    saved_chars: int = 0
    query: str = field(default="", repr=False)
    user_message: str = field(default="", repr=False)
    index_evictions: int = 0
    dropped_turns: int = 0
    prompt_tokens: int = 0
    budget: int | None = None
    trim_before: int = 0
    opens_conversation: bool = False
    history_sent: int = 0
    history: str = "none"
    history_dropped: tuple[int, int] = (0, 0)

    @property
    def key(self) -> ConversationKey:
        """The conversation key of this turn."""
        return ConversationKey(self.tenant, self.conversation_id)


def reserve_request(turn_input: TurnInput, config: CpMemoryConfig) -> ReserveRequest:
    """Return what the store must read for this request."""
    pairs = tuple((block.id, digest) for block, digest in zip(turn_input.blocks, turn_input.digests))
    sizes = None if turn_input.prompt_order is not None else tuple(_size(block) for block in turn_input.blocks)
    return ReserveRequest(
        pairs,
        config.reservation_timeout_s,
        include_transcript=True,  # a given history is compared with it (cpmemory.session.reconcile)
        history_turns=config.max_history_turns,
        order_sizes=sizes,
        match_prefix=opens_conversation(turn_input.history),
    )


def opens_conversation(history: Sequence[Message] | None) -> bool:
    """Whether the prompt's blocks come right after the system prompt (no user or assistant turn before them), so
    a recorded order's prefix can be cached for them. None (the stored transcript, not read yet): assumed so."""
    return history is None or all(message.get("role") == "system" for message in history)


def _size(block: Block) -> float:
    """What the online order weighs a block by: its characters (plus one, so an empty block still counts)."""
    return float(len(block.text) + 1)


def history_view(
    sent: SentHistory, reservation: Reservation, config: CpMemoryConfig, source: SegmentSource | None = None
) -> HistoryView:
    """How dedup looks up a block in the history sent: by content hash when possible, else by its text (from the
    conversation's cached history text when ``source`` keeps one, ``cpmemory.session.segments``)."""
    if not sent.stored or not sent.turns_known:
        given = getattr(source, "given", None)
        if given is not None and sent.messages:
            return given(sent.messages, config.label_digits, config.collision_label_digits)
        digits = {
            "label_digits": config.label_digits,
            "collision_label_digits": config.collision_label_digits,
        }
        return GivenHistory.from_messages(sent.messages, **digits)
    if sent.dropped_turns == 0:
        return CommittedHistory(reservation.seen)
    return CommittedHistory({h: s for h, s in reservation.seen.items() if s.turn > sent.dropped_turns})


SegmentSource = Callable[[Sequence[Message]], SegmentIndex]


def decide_blocks(
    turn_input: TurnInput,
    reservation: Reservation,
    sent: SentHistory,
    config: CpMemoryConfig,
    segments: SegmentIndex | None = None,
    source: SegmentSource | None = None,
) -> list[DedupDecision]:
    """Run the dedup rules against the history this request sends. Pure (``source`` may extend its cache).

    Args:
        segments: the segment index of the history sent (for partial overlap); None: no partial overlap.
        source: where ``segments`` came from (its cached history text serves a given history's lookups).
    """
    history = sent.messages
    view = history_view(sent, reservation, config, source)
    decisions = decide(turn_input.blocks, turn_input.digests, view, seen_hashes=reservation.seen,
                       previous_hash_for_id=reservation.previous_hash_for_id)
    if isinstance(view, CommittedHistory) and segments is not None:
        _unique_references(turn_input.blocks, decisions, history, segments)
    wants_partial = (
        config.partial_overlap
        and history
        and segments is not None
        and any(d.status == Status.NEW and b.text for d, b in zip(decisions, turn_input.blocks))
    )
    if wants_partial:
        assert segments is not None
        if len(segments):
            threshold = config.partial_overlap_threshold
            for i, (decision, block) in enumerate(zip(decisions, turn_input.blocks)):
                if decision.status == Status.NEW and block.text:
                    decisions[i] = partial_overlap(block.text, segments, threshold) or decision
    return decisions


def _unique_references(
    blocks: Sequence[Block], decisions: list[DedupDecision], history: Sequence[Message], segments: SegmentIndex
) -> None:
    """Resend (in full) a block whose committed label heads another text too in the history sent (mutates).

    Two overlapping turns can show two texts whose short labels collide (neither sees the other's uncommitted
    blocks); once both are committed, a reference to that label would be ambiguous. O(1) per referenced block,
    plus O(history) when its label heads more than one block of the history.
    """
    text = ""
    for i, decision in enumerate(decisions):
        if decision.status != Status.REFERENCED or decision.duplicate_of is not None:
            continue
        if not segments.header_repeated(decision.label):
            continue
        text = text or "\n\n".join(message["content"] for message in history)
        if not label_holds_only(text, decision.label, blocks[i].text):
            decisions[i] = DedupDecision(Status.RESENT)


def shown_indices(decisions: Sequence[DedupDecision]) -> list[int]:
    """Indices of the blocks written in the prompt (in full or in part), in relevance order."""
    return [i for i, decision in enumerate(decisions) if decision.in_full or decision.status == Status.PARTIAL]


def arrange(turn_input: TurnInput, shown: Sequence[int], prefix: Sequence[Hashable]) -> list[int]:
    """Return the prompt order of the shown blocks: ``prompt_order`` when given, else index prefix first.

    Blocks not named by the prefix (or by ``prompt_order``) follow in relevance order. Pure; O(k).
    """
    if turn_input.prompt_order is not None:
        rank = {block_id: r for r, block_id in enumerate(turn_input.prompt_order)}
        first = sorted(
            (i for i in shown if turn_input.blocks[i].id in rank), key=lambda i: rank[turn_input.blocks[i].id]
        )
    else:
        where = {turn_input.digests[i]: i for i in shown}  # shown blocks have distinct contents
        first = [where[key] for key in dict.fromkeys(prefix) if key in where]
    placed = set(first)
    return first + [i for i in shown if i not in placed]


def render_user_message(
    turn_input: TurnInput,
    decisions: Sequence[DedupDecision],
    order: Sequence[int],
    config: CpMemoryConfig,
    labels: Sequence[str],
) -> tuple[str, list[int | None], bool]:
    """Write the user message. Returns (text, prompt position per block, whether the order was annotated). Pure.

    Args:
        labels: each block's label in this prompt (cpmemory.session.labels.assign_labels).
    """
    blocks = turn_input.blocks
    positions: list[int | None] = [None] * len(blocks)
    sections: list[str] = []
    for position, i in enumerate(order):
        decision = decisions[i]
        positions[i] = position
        if decision.status == Status.PARTIAL:
            sections.append(
                annotations.format_partial(labels[i], decision.new_segments, decision.holder_labels)
            )
        else:
            sections.append(annotations.format_block(labels[i], blocks[i].text))
    references: list[str] = []
    for i, decision in enumerate(decisions):
        if decision.status == Status.REFERENCED and decision.duplicate_of is None:
            positions[i] = len(order) + len(references)
            references.append(labels[i])
    for i, decision in enumerate(decisions):
        if decision.duplicate_of is not None:
            positions[i] = positions[decision.duplicate_of]
    relevance = list(dict.fromkeys(labels))
    appearance = list(dict.fromkeys([labels[i] for i in order] + references))
    # A shown text holding a line that looks like the annotation: the real one is always written (right before
    # the question), so the line before the question is never block text.
    lookalike = any(annotations.ORDER_PREFIX in section for section in sections)
    annotate = config.annotate_order and (appearance != relevance or (lookalike and bool(relevance)))
    text = annotations.build_user_message(
        sections, references, relevance if annotate else None, turn_input.query, appearance
    )
    return text, positions, annotate


def assemble_messages(
    system_prompt: str, history: Sequence[Mapping[str, Any]], user: str
) -> list[dict[str, Any]]:
    """System prompt (unless the history starts with one), the history unchanged (every field), then the user
    message."""
    messages: list[dict[str, Any]] = []
    if not (history and history[0]["role"] == "system"):
        messages.append({"role": "system", "content": system_prompt})
    messages.extend(copy.deepcopy(dict(m)) if len(m) > 2 or not isinstance(m.get("content"), str) else dict(m)
                    for m in history)
    messages.append({"role": "user", "content": user})
    return messages


def plan_turn(
    turn_input: TurnInput,
    reservation: Reservation,
    indexes: TenantIndexes,
    config: CpMemoryConfig,
    segment_source: SegmentSource | None = None,
    sent: SentHistory | None = None,
) -> PreparedTurn:
    """Decide dedup, place the request in the tenant's index, order and write the prompt (mutates the index only).

    Args:
        sent: the history to send; None: ``sent_history`` (the turn window of ``max_history_turns``).
    """
    if sent is None:
        sent = sent_history(turn_input.history, reservation, config.max_history_turns)
    segments = (segment_source or SegmentIndex.from_messages)(sent.messages) if sent.messages else None
    decisions = decide_blocks(turn_input, reservation, sent, config, segments, segment_source)
    context = LabelContext(
        sent.messages, segments, reservation.seen, config.label_digits, config.collision_label_digits
    )
    labels = assign_labels(turn_input.blocks, turn_input.digests, decisions, context)
    shown = shown_indices(decisions)
    tenant = turn_input.key.tenant
    request_id = uuid.uuid4().hex if shown else ""
    if turn_input.prompt_order is not None:
        order = arrange(turn_input, shown, ())
        placement = indexes.place(tenant, _context(turn_input, order), request_id)
    else:
        keys = _context(turn_input, shown)
        placement = indexes.order_and_place(
            tenant, keys, _sizes(turn_input, shown, keys), request_id, reservation.shared_order
        )
        order = arrange(turn_input, shown, placement.prefix)
    text, positions, annotated = render_user_message(turn_input, decisions, order, config, labels)
    if request_id:  # the user message's own characters (question, template) go into the cache after the blocks
        indexes.note_tail(tenant, len(text) - sum(_size(turn_input.blocks[i]) for i in shown))
    delivered = _delivered(turn_input, sent)
    messages = assemble_messages(turn_input.system_prompt, delivered, text)
    return PreparedTurn(
        reservation_id=reservation.reservation_id,
        tenant=tenant,
        conversation_id=turn_input.key.conversation,
        turn=reservation.turn + 1,
        request_id=request_id,
        messages=messages,
        decisions=_block_decisions(turn_input, decisions, positions, labels),
        prompt_order=[turn_input.blocks[i].id for i in order if decisions[i].in_full],
        dropped_turns=sent.dropped_turns,
        search_path=placement.search_path,
        order_annotated=annotated,
        index_evictions=len(placement.evicted),
        saved_chars=sum(decision.saved_chars for decision in decisions),
        query=turn_input.query,
        user_message=text,
        opens_conversation=opens_conversation(messages[:-1]),
        history_sent=len(delivered),
    )


def _context(turn_input: TurnInput, indices: Sequence[int]) -> list[str]:
    """Distinct content hashes of the given blocks, in the given order (the index's keys)."""
    return list(dict.fromkeys(turn_input.digests[i] for i in indices))


def _sizes(turn_input: TurnInput, shown: Sequence[int], context: Sequence[str]) -> list[float]:
    """Characters of each content key of ``context`` (what the online order weighs blocks by)."""
    length = {turn_input.digests[i]: _size(turn_input.blocks[i]) for i in shown}
    return [float(length[key]) for key in context]


def _delivered(turn_input: TurnInput, sent: SentHistory) -> Sequence[Mapping[str, Any]]:
    """The history messages to send: a caller-given history as given, else the stored transcript (window)."""
    given, read = turn_input.given_history, turn_input.history
    if sent.stored or given is None or read is None:
        return sent.messages
    # a budget keeps a suffix of the given history (sent.messages is a tail of ``read``): send the same tail
    kept = len(sent.messages)
    assert kept <= len(given) and tuple(read[len(read) - kept :]) == tuple(sent.messages)
    return given[len(given) - kept :]


def _block_decisions(
    turn_input: TurnInput,
    decisions: Sequence[DedupDecision],
    positions: Sequence[int | None],
    labels: Sequence[str],
) -> list[BlockDecision]:
    """One decision per caller item (an item repeating an earlier one is a "referenced" duplicate of it)."""
    items = turn_input.items or tuple(range(len(turn_input.blocks)))
    first: dict[int, int] = {}
    out: list[BlockDecision] = []
    for rank, index in enumerate(items):
        block, digest, decision = turn_input.blocks[index], turn_input.digests[index], decisions[index]
        if index in first:
            decision = DedupDecision(Status.REFERENCED, index, saved_chars=len(block.text))
            duplicate_of: int | None = first[index]
        else:
            first[index] = rank
            earlier = decision.duplicate_of
            duplicate_of = None if earlier is None else first.get(earlier, earlier)
        out.append(
            BlockDecision(
                block.id, labels[index], decision.status, rank, positions[index], digest,
                decision.saved_chars, duplicate_of,
            )
        )
    return out


def degraded_turn(
    turn_input: TurnInput, config: CpMemoryConfig, history: Sequence[Mapping[str, Any]] | None = None, turn: int = 0
) -> PreparedTurn:
    """Pass-through when the store failed: relevance order, every block in full, nothing reserved or indexed.

    Args:
        history: the history to send (a local copy of the transcript); None: the caller's, if any.
        turn: the number the turn gets (0: unknown).
    """
    decisions = [DedupDecision(Status.NEW) for _ in turn_input.blocks]
    order = list(range(len(turn_input.blocks)))
    context = LabelContext(digits=config.label_digits, longer=config.collision_label_digits)
    labels = assign_labels(turn_input.blocks, turn_input.digests, decisions, context)
    text, positions, _ = render_user_message(turn_input, decisions, order, config, labels)
    if history is None:
        history = turn_input.given_history or ()
    return PreparedTurn(
        reservation_id="",
        tenant=turn_input.key.tenant,
        conversation_id=turn_input.key.conversation,
        turn=turn,
        request_id="",
        messages=assemble_messages(turn_input.system_prompt, history, text),
        decisions=_block_decisions(turn_input, decisions, positions, labels),
        prompt_order=[block.id for block in turn_input.blocks],
        degraded=True,
        query=turn_input.query,
        user_message=text,
        history_sent=len(history),
    )


def commit_record(turn: PreparedTurn, answer: str) -> TurnRecord:
    """Return what commit makes durable: the user message as sent, the answer, and the blocks shown in full."""
    if not isinstance(answer, str):
        raise InvalidInputError(f"answer must be a string, got {type(answer).__name__}")
    user = turn.user_message or turn.messages[-1]["content"]
    shown = tuple(
        SeenBlock(d.block_id, d.content_hash, d.label, turn.turn)
        for d in turn.decisions
        if d.status in FULL_TEXT_STATUSES
    )
    messages = ({"role": "user", "content": user}, {"role": "assistant", "content": answer})
    return TurnRecord(
        messages=messages,
        shown=shown,
        search_path=turn.search_path,
        trim_before=turn.trim_before,
        # a prompt that opens with earlier turns (a later turn) is cached after them: no other request's prefix
        sent_order=sent_order(turn) if turn.opens_conversation else (),
        request_id=turn.request_id,
    )


def sent_order(turn: PreparedTurn) -> tuple[str, ...]:
    """The content hashes shown in full, in prompt order (what the engine caches after the system prompt)."""
    digest = {d.block_id: d.content_hash for d in turn.decisions}
    return tuple(dict.fromkeys(digest[block_id] for block_id in turn.prompt_order if block_id in digest))


def turn_counts(turn: PreparedTurn, chars_per_token: float) -> dict[str, int]:
    """Counter increments for one prepared turn."""
    statuses = [decision.status for decision in turn.decisions]
    return {
        "prepares": 1,
        "blocks": len(statuses),
        "blocks_referenced": statuses.count(Status.REFERENCED),
        "blocks_partial": statuses.count(Status.PARTIAL),
        "blocks_changed": statuses.count(Status.CHANGED),
        "blocks_resent": statuses.count(Status.RESENT),
        "order_annotations": int(turn.order_annotated),
        "dedup_chars_saved": turn.saved_chars,
        "dedup_tokens_saved": int(turn.saved_chars / chars_per_token),
        "index_evictions": turn.index_evictions,
    }
