"""A per-conversation cache of the history's segment index (for partial-overlap dedup).

A conversation's history normally only grows (commits append; clients resend their history plus one turn), so the
index built for its first n messages is extended with the new messages only: partial-overlap detection costs
O(new text) per request instead of O(history). Each entry keeps a fingerprint (Python hash of role and content) per
indexed message; a history whose messages differ from the fingerprints (edited, truncated at the front, another
conversation after expiry) gets a fresh index. Requests get a view limited to the messages they send
(SegmentIndex.limited_to), so a request that sends a shorter history never sees segments it does not send.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cpmemory.core.dedup import SegmentIndex
from cpmemory.types import ConversationKey, Message


@dataclass(slots=True)
class _Entry:
    index: SegmentIndex = field(default_factory=SegmentIndex)
    prints: list[int] = field(default_factory=list)


def _fingerprints(history: Sequence[Message]) -> list[int]:
    # str hashes are cached on the string objects, so a transcript read from the in-memory store costs O(messages).
    return [hash((message["role"], message["content"])) for message in history]


class SegmentCache:
    """LRU of conversation -> segment index of its latest history (thread-safe, bounded)."""

    def __init__(self, max_conversations: int = 10_000) -> None:
        self._max = max_conversations
        self._entries: OrderedDict[ConversationKey, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def for_history(self, key: ConversationKey, history: Sequence[Message]) -> SegmentIndex:
        """Return the segment index of ``history``, extending (or rebuilding) the cached one (mutates the cache)."""
        prints = _fingerprints(history)
        with self._lock:
            entry = self._entries.get(key)
            shared = 0 if entry is None else min(len(entry.prints), len(prints))
            if entry is None or entry.prints[:shared] != prints[:shared]:
                entry = self._entries[key] = _Entry()
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
            done = len(entry.prints)
            if done < len(prints):
                entry.index.extend(history[done:])
                entry.prints.extend(prints[done:])
            return entry.index.limited_to(len(history))

    def forget(self, key: ConversationKey) -> None:
        """Drop the entry of one conversation."""
        with self._lock:
            self._entries.pop(key, None)
