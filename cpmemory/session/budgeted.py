"""Planning a turn under a token budget (pure but for the tenant index, like ``plan_turn``).

``check_turn_alone`` runs before anything is reserved: every block must fit the budget, and so must the new turn
alone (system prompt, every block in full, the order annotation, the question): otherwise PromptBudgetError.

``plan_budgeted`` then picks the history window (``cpmemory.session.window``): the window the store returned if the
prompt fits; otherwise, with ``history_window="restart"``, the most recent turns that fit ``history_restart_keep``
of the budget, dropping one more turn at a time until the prompt fits (blocks whose copy left the window are resent
in full, so every prompt is planned again against the history it really sends); with ``"sliding"``, the oldest
turns one at a time. Each try is a full ``plan_turn`` measured by the budget's counter; a try that does not fit is
taken back out of the tenant's index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cpmemory.core import annotations
from cpmemory.core.dedup import DedupDecision
from cpmemory.errors import PromptBudgetError
from cpmemory.session.budget import PromptBudget, check_block_sizes
from cpmemory.session.config import CpMemoryConfig
from cpmemory.session.index import TenantIndexes
from cpmemory.session.labels import LabelContext, assign_labels
from cpmemory.session.turn_input import TurnInput
from cpmemory.session.turns import (
    PreparedTurn,
    SegmentSource,
    assemble_messages,
    plan_turn,
)
from cpmemory.session.window import SentHistory, restart_start, sent_history, turn_offsets
from cpmemory.types import Message, Reservation, Status

GIVEN_HISTORY_CHUNKS = 8
"""A caller-given history is cut only where a message starts a new 1/8 of the budget (stable cut points)."""


def turn_alone_messages(turn_input: TurnInput, config: CpMemoryConfig) -> list[dict[str, str]]:
    """The largest prompt the new turn can need with no history: every block in full, order annotated. Pure."""
    decisions = [DedupDecision(Status.NEW) for _ in turn_input.blocks]
    context = LabelContext(digits=config.label_digits, longer=config.collision_label_digits)
    labels = assign_labels(turn_input.blocks, turn_input.digests, decisions, context)
    sections = [
        annotations.format_block(label, block.text) for label, block in zip(labels, turn_input.blocks)
    ]
    relevance = list(dict.fromkeys(labels))
    order = relevance if config.annotate_order and len(relevance) > 1 else None
    user = annotations.build_user_message(sections, [], order, turn_input.query, None)
    return assemble_messages(turn_input.system_prompt, (), user)


def check_turn_alone(turn_input: TurnInput, config: CpMemoryConfig, budget: PromptBudget) -> int:
    """Raise PromptBudgetError (or TokenCounterError) unless the new turn fits alone; return its size. Pure.

    Called before ``reserve``: a turn that cannot fit changes nothing.
    """
    check_block_sizes(budget, (block.text for block in turn_input.blocks))
    needed = budget.messages(turn_alone_messages(turn_input, config))
    if needed > budget.limit:
        raise PromptBudgetError(
            f"the new turn alone (system prompt, every block in full, annotations, question) has {needed} tokens, "
            f"over the budget of {budget.limit}; pass fewer or shorter blocks, or a larger budget",
            budget.limit,
            needed,
        )
    return needed


def _turn_groups(sent: SentHistory, reservation: Reservation) -> list[tuple[Message, ...]]:
    """The sent stored history split into its committed turns (oldest first)."""
    offsets, _ = turn_offsets(reservation)
    skip = sent.dropped_turns - reservation.transcript_start
    base = offsets[skip] if skip < len(offsets) else 0
    starts = [offset - base for offset in offsets[skip:]] or [0]
    ends = starts[1:] + [len(sent.messages)]
    return [tuple(sent.messages[a:b]) for a, b in zip(starts, ends) if b > a]


def _message_groups(
    messages: Sequence[Message], budget: PromptBudget, chunk: int
) -> list[tuple[Message, ...]]:
    """A caller-given history cut where a message starts a new chunk of ``chunk`` tokens.

    The cuts depend only on the messages before them, so they stay put as the history grows (prefix-stable). A cut
    never falls before a tool result: an assistant's tool call and its results are kept or dropped together.
    """
    groups: list[list[Message]] = []
    total, current = 0, -1
    for message in messages:
        if total // chunk != current and (not groups or message.get("role") != "tool"):
            current = total // chunk
            groups.append([])
        groups[-1].append(message)
        total += budget.message(message)
    return [tuple(group) for group in groups]


def plan_budgeted(
    turn_input: TurnInput,
    reservation: Reservation,
    indexes: TenantIndexes,
    config: CpMemoryConfig,
    budget: PromptBudget,
    segment_source: SegmentSource | None = None,
) -> PreparedTurn:
    """Plan the turn with the largest prefix-stable history window whose prompt fits ``budget``.

    Raises:
        PromptBudgetError: not even the turn with no history fits (``check_turn_alone`` normally catches it first).
        TokenCounterError: the counter failed on a history message.
    """
    base = sent_history(turn_input.history, reservation, config.max_history_turns)
    if base.stored:
        groups = _turn_groups(base, reservation)
    else:
        chunk = max(1, budget.limit // GIVEN_HISTORY_CHUNKS)
        groups = _message_groups(base.messages, budget, chunk)

    def attempt(drop: int, source: SegmentSource | None) -> PreparedTurn | None:
        messages = tuple(message for group in groups[drop:] for message in group)
        dropped = base.dropped_turns + drop if base.stored else 0
        sent = SentHistory(messages, base.stored, dropped, base.turns_known)
        turn = plan_turn(turn_input, reservation, indexes, config, source, sent)
        tokens = budget.messages(turn.messages)
        if tokens <= budget.limit:
            trim = dropped if base.stored else 0
            return dataclasses.replace(turn, prompt_tokens=tokens, budget=budget.limit, trim_before=trim)
        if turn.request_id:
            indexes.evict(turn_input.key.tenant, [turn.request_id])
        return None

    fitted = attempt(0, segment_source)
    if fitted is not None:
        return fitted
    if config.history_window == "sliding" or not groups:
        first = 1
    else:
        sizes = [budget.messages(group) for group in groups]
        first = restart_start(sizes, 0, int(config.history_restart_keep * budget.limit))
    for drop in range(max(1, first), len(groups) + 1):
        fitted = attempt(drop, None)
        if fitted is not None:
            return fitted
    raise PromptBudgetError(
        f"the turn does not fit the budget of {budget.limit} tokens even with no history", budget.limit
    )


def fit_degraded(turn: PreparedTurn, budget: PromptBudget) -> PreparedTurn:
    """A pass-through turn cut to the budget: the oldest history messages are dropped until it fits, a message
    together with the tool results that follow it (a tool call and its results go together).

    The turn alone fits (``check_turn_alone`` ran before the store was asked), so this always ends within the budget.
    """
    messages = list(turn.messages)
    tokens = budget.messages(messages)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    cut = 0
    while tokens > budget.limit and len(messages) - first > 1:
        end = first + 1
        while end < len(messages) - 1 and messages[end].get("role") == "tool":
            end += 1
        tokens -= budget.messages(messages[first:end])
        cut += end - first
        del messages[first:end]
    return dataclasses.replace(turn, messages=messages, prompt_tokens=tokens, budget=budget.limit,
                               history_sent=max(0, turn.history_sent - cut))
