"""A bounded local copy of recent conversations, so a store outage never makes the model forget (no IO).

While the store answers, the facade keeps, per conversation, the transcript it last read or committed and the number
of committed turns. When the store cannot be reached:

* a turn of a conversation known here gets that transcript as its history (in the turn window of
  ``max_history_turns``) and the next turn number;
* its commit is kept here (with the reservation it had, if any) and written back, in order, the next time a turn of
  that conversation reaches the store (:meth:`RecentTranscripts.take`): a commit that failed is first retried under
  its own reservation (idempotent: one that had landed is not recorded twice), the others go through a new
  reservation each, appended after whatever the store holds. A store that came back without the turns it had (a
  restart without persistence) first gets the committed turns this copy still holds, without their seen blocks
  (their blocks are sent in full again rather than referred to).

The copy is bounded by characters over all conversations (least recently used dropped first); a conversation
dropped with commits not yet written back loses them, counted by the caller. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cpmemory.session.window import turn_offsets, window_start
from cpmemory.types import ConversationKey, Message, Reservation, TurnRecord

LOCAL_HISTORY_CHARS = 32_000_000
"""Characters of transcript the copy holds over all conversations (it bounds the copy's memory)."""


@dataclass(frozen=True, slots=True)
class Kept:
    """A commit kept while the store was unreachable: its reservation ("" for a degraded turn) and record."""

    reservation_id: str
    record: TurnRecord


@dataclass(slots=True)
class _Copy:
    turns: int = 0  # committed turns (the store's count, then this copy's)
    known: bool = True  # False: the conversation was first seen during an outage (its earlier turns are unknown)
    start: int = 0  # committed turns before the first one held
    turns_held: list[tuple[Message, ...]] = field(default_factory=list)
    unwritten: list[Kept] = field(default_factory=list)
    chars: int = 0


def _chars(messages: Sequence[Message]) -> int:
    return sum(len(message["content"]) for message in messages)


@dataclass(frozen=True, slots=True)
class LocalHistory:
    """What a turn sent during an outage gets: the history messages held (for a conversation first seen during the
    outage, its turns since), the committed turns before it, and whether the conversation's earlier turns are known
    here (else its turns are not numbered)."""

    messages: tuple[Message, ...]
    turns: int
    known: bool
    start: int = 0


@dataclass(frozen=True, slots=True)
class WriteBack:
    """Records to write to the store at the next turn that reaches it, in order: ``rewrite`` (committed turns a
    store that lost them should get back, each with its turn number) and ``kept`` (commits made meanwhile)."""

    rewrite: tuple[tuple[int, TurnRecord], ...]
    kept: tuple[Kept, ...]


class RecentTranscripts:
    """The local copy (see the module docstring)."""

    def __init__(self, max_chars: int = LOCAL_HISTORY_CHARS, on_lost: Callable[[int], None] | None = None) -> None:
        """``on_lost``: told how many kept commits were dropped with their conversation (the bound)."""
        self.max_chars = max_chars
        self._copies: OrderedDict[ConversationKey, _Copy] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._on_lost = on_lost or (lambda count: None)

    def __len__(self) -> int:
        return len(self._copies)

    # -- the store answered ----------------------------------------------------------------------------------------
    def seen(self, key: ConversationKey, reservation: Reservation) -> None:
        """The store answered a reserve: take its transcript when this copy does not hold the same turn count."""
        transcript = reservation.transcript
        with self._lock:
            copy = self._copies.get(key)
            if copy is not None and copy.known and copy.turns == reservation.turn and not copy.unwritten:
                self._copies.move_to_end(key)
                return
            if transcript is None or (copy is not None and copy.unwritten):
                return
            offsets, exact = turn_offsets(reservation)
            if not exact:
                return
            ends = [*offsets[1:], len(transcript)]
            held = [tuple(transcript[a:b]) for a, b in zip(offsets, ends)]
            self._put(key, _Copy(reservation.turn, True, reservation.transcript_start, held))

    def committed(self, key: ConversationKey, number: int, record: TurnRecord) -> None:
        """A turn reached the store as turn ``number``."""
        with self._lock:
            copy = self._copies.get(key)
            if copy is None or not copy.known or copy.turns != number - 1:
                copy = _Copy(number - 1, True, number - 1)  # turns committed elsewhere meanwhile: start afresh
            self._append(copy, tuple(record.messages), record.trim_before)
            self._put(key, copy)

    # -- the store is unreachable ---------------------------------------------------------------------------------
    def history(self, key: ConversationKey, max_turns: int | None) -> LocalHistory:
        """The history a turn gets while the store is unreachable (the turn window of ``max_turns``)."""
        with self._lock:
            copy = self._copies.get(key)
            if copy is None:
                return LocalHistory((), 0, False)
            self._copies.move_to_end(key)
            skip = max(0, window_start(copy.turns, max_turns) - copy.start)
            messages = tuple(message for turn in copy.turns_held[skip:] for message in turn)
            return LocalHistory(messages, copy.turns, copy.known, copy.start + skip)

    def keep(self, key: ConversationKey, kept: Kept) -> int:
        """Keep a commit the store could not take; returns its turn number here (0: the conversation's earlier
        turns are unknown here)."""
        with self._lock:
            copy = self._copies.get(key) or _Copy(known=False)
            copy.unwritten.append(kept)
            self._append(copy, tuple(kept.record.messages), kept.record.trim_before)
            self._put(key, copy)
            return copy.turns if copy.known else 0

    # -- write-back -------------------------------------------------------------------------------------------------
    def pending(self, key: ConversationKey) -> bool:
        """Whether commits of this conversation wait to be written back."""
        with self._lock:
            copy = self._copies.get(key)
            return copy is not None and bool(copy.unwritten)

    def take(self, key: ConversationKey, stored_turns: int) -> WriteBack:
        """The records to write now that the store holds ``stored_turns`` committed turns; the kept commits leave
        the copy (give back what was not written with :meth:`give_back`)."""
        with self._lock:
            copy = self._copies.get(key)
            if copy is None or not copy.unwritten:
                return WriteBack((), ())
            kept = tuple(copy.unwritten)
            copy.unwritten.clear()
            written = copy.turns - len(kept)  # turns that had reached the store before the outage
            rewrite: list[tuple[int, TurnRecord]] = []
            if copy.known and stored_turns < written:  # the store lost turns: give back those still held here
                for number in range(max(stored_turns, copy.start) + 1, written + 1):
                    rewrite.append((number, TurnRecord(copy.turns_held[number - copy.start - 1], ())))
            return WriteBack(tuple(rewrite), kept)

    def give_back(self, key: ConversationKey, kept: Sequence[Kept]) -> None:
        """Kept commits a write-back could not write: they wait again, first."""
        if not kept:
            return
        with self._lock:
            copy = self._copies.get(key)
            if copy is None:
                self._on_lost(len(kept))
                return
            copy.unwritten[:0] = list(kept)

    def written(self, key: ConversationKey) -> None:
        """A write-back ended: the copy is dropped, and the next reserve's transcript (the store's numbering) fills
        it again."""
        self.forget(key)

    def forget(self, key: ConversationKey) -> None:
        """Drop a conversation's copy (its state was deleted)."""
        with self._lock:
            copy = self._copies.pop(key, None)
            if copy is not None:
                self._chars -= copy.chars

    # -- internals (under the lock) ---------------------------------------------------------------------------------
    def _append(self, copy: _Copy, messages: tuple[Message, ...], trim_before: int) -> None:
        copy.turns += 1
        copy.turns_held.append(messages)
        drop = min(trim_before, copy.turns - 1) - copy.start
        if drop > 0:
            del copy.turns_held[:drop]
            copy.start += drop

    def _put(self, key: ConversationKey, copy: _Copy) -> None:
        """(Re)insert a copy as the most recent; ``chars`` of a copy already held still counts what it held."""
        old = self._copies.pop(key, None)
        if old is not None:
            self._chars -= old.chars
        copy.chars = sum(_chars(turn) for turn in copy.turns_held)
        self._copies[key] = copy
        self._chars += copy.chars
        while self._chars > self.max_chars and len(self._copies) > 1:
            _, dropped = self._copies.popitem(last=False)
            self._chars -= dropped.chars
            if dropped.unwritten:
                self._on_lost(len(dropped.unwritten))
        while self._chars > self.max_chars and len(copy.turns_held) > 1:  # one conversation over the bound alone
            size = _chars(copy.turns_held.pop(0))
            copy.start += 1
            copy.chars -= size
            self._chars -= size
