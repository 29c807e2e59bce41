"""A per-conversation cache of the history's segment index (for partial-overlap dedup).

A conversation's history normally only grows (commits append; clients resend their history plus one turn), so the
index built for its first n messages is extended with the new messages only: partial-overlap detection costs
O(new text) per request instead of O(history). Each entry keeps a fingerprint (Python hash of role and content) per
indexed message; a history whose messages differ from the fingerprints (edited, truncated at the front, another
conversation after expiry) gets a fresh index. Requests get a view limited to the messages they send
(SegmentIndex.limited_to), so a request that sends a shorter history never sees segments it does not send.

The same entry keeps the history's text as a caller-given history is searched (its contents joined, with the
position of every block header, :class:`HistoryText`), extended with the new messages only, so dedup against a
given history costs O(new text) too instead of a regex pass over the whole history per request.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cpmemory.core.annotations import LABEL_PATTERN
from cpmemory.core.dedup import GivenHistory, SegmentIndex, header_positions
from cpmemory.types import ConversationKey, Message

_TAIL_HEADER = re.compile(r"\[(" + LABEL_PATTERN + r")\]\Z")
_LONGEST_HEADER = 36  # "[" + "D" + 32 hex digits + "]", and a little more


@dataclass(slots=True)
class HistoryText:
    """A history's contents joined by blank lines (``GivenHistory.from_messages``) and its header positions,
    grown one message at a time (mutates; the cache's lock serialises it)."""

    text: str = ""
    messages: int = 0
    headers: dict[str, list[int]] = field(default_factory=dict)
    _view: GivenHistory | None = None

    def extend(self, messages: Sequence[Message]) -> None:
        """Append ``messages`` (O(their length), plus a copy of the text)."""
        for message in messages:
            content = message["content"]
            offset = 0
            if self.messages:
                # a header ending the previous message is followed by the blank line: "[<label>]\n" in the join
                tail = _TAIL_HEADER.search(self.text[-_LONGEST_HEADER:])
                if tail is not None:
                    start = len(self.text) - len(tail.group(0))
                    self.headers.setdefault(tail.group(1), []).append(start)
                offset = len(self.text) + 2
                self.text = self.text + "\n\n" + content
            else:
                self.text = content
            for label, positions in header_positions(content, offset).items():
                self.headers.setdefault(label, []).extend(positions)
            self.messages += 1
            self._view = None

    def view(self, label_digits: int, collision_label_digits: int) -> GivenHistory:
        """The GivenHistory of the messages so far (a snapshot: later extensions do not change it)."""
        view = self._view
        if view is None or (view.label_digits, view.collision_label_digits) != (label_digits, collision_label_digits):
            headers = {label: tuple(positions) for label, positions in self.headers.items()}
            view = self._view = GivenHistory(self.text, label_digits, collision_label_digits, headers)
        return view


@dataclass(slots=True)
class _Entry:
    index: SegmentIndex = field(default_factory=SegmentIndex)
    prints: list[int] = field(default_factory=list)
    text: HistoryText = field(default_factory=HistoryText)


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

    def given_history(
        self, key: ConversationKey, history: Sequence[Message], label_digits: int, collision_label_digits: int
    ) -> GivenHistory:
        """The GivenHistory of ``history`` (what ``GivenHistory.from_messages`` returns), from the cached text of the
        conversation's history when ``history`` extends it (call :meth:`for_history` first; mutates the cache)."""
        prints = _fingerprints(history)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.prints[: len(prints)] == prints and entry.text.messages <= len(prints):
                entry.text.extend(history[entry.text.messages :])
                return entry.text.view(label_digits, collision_label_digits)
        return GivenHistory.from_messages(history, label_digits=label_digits,
                                          collision_label_digits=collision_label_digits)

    def source(self, key: ConversationKey) -> ConversationHistory:
        """The cached views of one conversation's history, for ``plan_turn`` (its ``segment_source``)."""
        return ConversationHistory(self, key)

    def forget(self, key: ConversationKey) -> None:
        """Drop the entry of one conversation."""
        with self._lock:
            self._entries.pop(key, None)


@dataclass(frozen=True, slots=True)
class ConversationHistory:
    """One conversation's cached history views: called, its segment index; ``given``, its GivenHistory."""

    cache: SegmentCache
    key: ConversationKey

    def __call__(self, history: Sequence[Message]) -> SegmentIndex:
        return self.cache.for_history(self.key, history)

    def given(self, history: Sequence[Message], label_digits: int, collision_label_digits: int) -> GivenHistory:
        return self.cache.given_history(self.key, history, label_digits, collision_label_digits)
