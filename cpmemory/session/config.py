"""Configuration of the facade (pydantic v2; validated once, frozen)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cpmemory.core.blocks import LABEL_HEX_DIGITS
from cpmemory.core.dedup import COLLISION_LABEL_DIGITS, FULL_LABEL_DIGITS

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents provided. "
    "Each document starts with its label in brackets."
)


class CpMemoryConfig(BaseModel):
    """Tunables of :class:`cpmemory.CpMemory`.

    Attributes:
        alpha: position weight of the context distance (the paper's alpha, 0.001-0.01).
        system_prompt: first message of every prompt unless the call passes its own.
        reservation_timeout_s: seconds a prepared turn may stay open before commit fails with ReservationExpiredError.
        ttl_s: seconds a conversation lives in the default in-memory store after its last use (None: forever).
        partial_overlap: enable partial-overlap de-duplication (see cpmemory.core.dedup).
        partial_overlap_threshold: fraction of a block's characters that must be present earlier for "partial".
        max_leaves_per_tenant: bound on each tenant's context index (oldest requests are evicted first).
        annotate_order: add the order annotation when the prompt order differs from the relevance order.
        max_pending_turns: bound on prepared turns remembered for commit/abort by reservation id.
        chars_per_token: used to estimate the tokens saved by de-duplication in the counters.
        max_history_turns: with the stored transcript (``history=None``), send at most this many of the most recent
            committed turns (the system prompt is always sent). None sends the whole transcript (the default: the
            prompt only ever grows, so every turn extends the previous turn's prefix). The window restarts at a
            multiple of N turns (``cpmemory.session.turns.window_start``): it keeps 1 to N turns, and consecutive
            turns share their whole history prefix between two restarts. Blocks whose text falls out of the window
            are sent in full again ("resent"). A history passed by the caller is never cut.
        max_prompt_tokens: the token budget B of every prompt (None: no budget). Every prompt the facade builds then
            fits B under ``token_counter`` (system prompt, history, blocks, annotations, question); the history window
            is chosen by tokens (``history_window``); a turn that cannot fit even with no history raises
            PromptBudgetError before anything is reserved. ``prepare(max_prompt_tokens=...)`` overrides it per call.
        token_counter: counts the tokens of one text (any ``Callable[[str], int]``); None uses
            ``cpmemory.session.budget.estimate_tokens`` (see there for its measured margin).
        message_overhead_tokens: tokens counted per chat message on top of its content (role markers).
        history_window: how the history window follows the budget. "restart" (default): the window only grows
            until the next turn would not fit, then restarts keeping the most recent turns that fit in
            ``history_restart_keep`` of the budget; between two restarts every prompt extends the previous one (the
            engine's prefix cache keeps matching), as ``max_history_turns`` does by turns. "sliding": the window
            drops the oldest turns until the prompt fits (changes the prefix on every turn; kept as a baseline).
        history_restart_keep: fraction of the budget the history keeps at a restart (0: restart with no history).
        label_digits: hex digits of the content hash in a block's label ("D" + digits; 7 to 32).
        collision_label_digits: digits of the longer label a block gets when its label already names another text
            in the prompt (see cpmemory.session.labels); more than ``label_digits``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    alpha: float = Field(0.001, ge=0.0, lt=1.0)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    reservation_timeout_s: float = Field(120.0, gt=0.0)
    ttl_s: float | None = Field(24 * 3600.0, gt=0.0)
    partial_overlap: bool = True
    partial_overlap_threshold: float = Field(0.5, gt=0.0, le=1.0)
    max_leaves_per_tenant: int = Field(100_000, ge=1)
    annotate_order: bool = True
    max_pending_turns: int = Field(10_000, ge=1)
    chars_per_token: float = Field(4.0, gt=0.0)
    max_history_turns: int | None = Field(None, ge=1)
    max_prompt_tokens: int | None = Field(None, ge=1, strict=True)
    token_counter: Callable[[str], int] | None = None
    message_overhead_tokens: int = Field(8, ge=0)
    history_window: Literal["restart", "sliding"] = "restart"
    history_restart_keep: float = Field(0.25, ge=0.0, lt=1.0)
    label_digits: int = Field(LABEL_HEX_DIGITS, ge=LABEL_HEX_DIGITS, le=FULL_LABEL_DIGITS)
    collision_label_digits: int = Field(COLLISION_LABEL_DIGITS, gt=LABEL_HEX_DIGITS, le=FULL_LABEL_DIGITS)

    @model_validator(mode="after")
    def _longer_collision_labels(self) -> CpMemoryConfig:
        if self.collision_label_digits <= self.label_digits and self.label_digits < FULL_LABEL_DIGITS:
            raise ValueError("collision_label_digits must be greater than label_digits")
        return self
