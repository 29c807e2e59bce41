"""A per-conversation cache of the stored transcript's segment index (for partial-overlap dedup).

The stored transcript only grows (commits append), so the index built for its first n messages stays valid and is
extended with the new messages only: partial-overlap detection costs O(new text) per request, not O(transcript).
An entry is rebuilt when the transcript no longer starts the same way (expired and restarted conversation).
Requests get a view limited to the messages they send (see SegmentIndex.limited_to), so a concurrent request that
sends a shorter transcript never sees segments it does not send.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cpmemory.core.dedup import SegmentIndex
from cpmemory.stores.base import ConversationKey, Message


@dataclass(slots=True)
class _Entry:
    index: SegmentIndex
    first: str
    last: str


class SegmentCache:
    """LRU of conversation -> segment index of its stored transcript (thread-safe, bounded)."""

    def __init__(self, max_conversations: int = 10_000) -> None:
        self._max = max_conversations
        self._entries: OrderedDict[ConversationKey, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def for_history(self, key: ConversationKey, history: Sequence[Message]) -> SegmentIndex:
        """Return the segment index of ``history`` (the stored transcript), extending the cached one (mutates)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not _still_valid(entry, history):
                entry = _Entry(SegmentIndex(), "", "")
                self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
            done = entry.index.messages
            if done < len(history):
                entry.index.extend(history[done:])
                entry.first, entry.last = history[0]["content"], history[-1]["content"]
            return entry.index.limited_to(len(history))

    def forget(self, key: ConversationKey) -> None:
        """Drop the entry of one conversation."""
        with self._lock:
            self._entries.pop(key, None)


def _still_valid(entry: _Entry, history: Sequence[Message]) -> bool:
    done = entry.index.messages
    if done == 0:
        return True
    if done > len(history):
        return False
    return history[0]["content"] == entry.first and history[done - 1]["content"] == entry.last
