"""Counters kept by the facade (the server exposes them as Prometheus metrics)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class FacadeCounters:
    """Monotonic counters of one facade instance. Thread-safe through ``add``; read with ``snapshot``.

    Attributes:
        prepares: turns prepared (degraded ones included).
        commits: turns committed.
        aborts: turns aborted.
        fallbacks: prepares served as degraded pass-through because the store failed.
        commit_failures: commits that failed because the store failed.
        late_commits: turns committed through a new reservation after theirs timed out (``commit(late=True)``).
        index_errors: index operations that failed (the turn kept the relevance order).
        blocks: blocks received.
        blocks_referenced: blocks replaced by a reference.
        blocks_partial: blocks sent in part.
        blocks_changed: blocks sent in full because their text changed.
        blocks_resent: blocks sent in full again because the history no longer held them.
        order_annotations: prompts that carry an order annotation.
        dedup_chars_saved: characters not sent thanks to de-duplication.
        dedup_tokens_saved: the same, in estimated tokens (chars / chars_per_token).
        index_evictions: leaves removed from the indexes (engine evictions, bound, aborts).
        histories_matched / histories_diverged / histories_none / histories_unchecked: how each prepared turn's
            history was used (``cpmemory.session.reconcile``).
        history_messages_dropped / history_turns_dropped: history left out of prompts (a token budget, the window).
        local_commits: commits kept locally while the store was unreachable; local_writebacks: those written back;
            local_commits_lost: those dropped with their conversation from the bounded local copy.
    """

    prepares: int = 0
    commits: int = 0
    aborts: int = 0
    fallbacks: int = 0
    commit_failures: int = 0
    late_commits: int = 0
    index_errors: int = 0
    blocks: int = 0
    blocks_referenced: int = 0
    blocks_partial: int = 0
    blocks_changed: int = 0
    blocks_resent: int = 0
    order_annotations: int = 0
    dedup_chars_saved: int = 0
    dedup_tokens_saved: int = 0
    index_evictions: int = 0
    histories_matched: int = 0
    histories_diverged: int = 0
    histories_none: int = 0
    histories_unchecked: int = 0
    history_messages_dropped: int = 0
    history_turns_dropped: int = 0
    local_commits: int = 0
    local_writebacks: int = 0
    local_commits_lost: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **increments: int) -> None:
        """Add each increment to the counter of that name (mutates; thread-safe)."""
        with self._lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        """Return a copy of every counter as a dict."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
