"""Configuration of the facade (pydantic v2; validated once, frozen)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

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
