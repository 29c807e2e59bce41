"""The history window: which committed turns a prompt sends (pure; no IO).

Two ways to bound it, both prefix-stable (between two restarts every prompt extends the previous one byte for byte,
so the engine's prefix cache keeps matching):

* by turns, ``CpMemoryConfig.max_history_turns`` = N: :func:`window_start` restarts the window every N turns (the
  store returns only that window: ``ReserveRequest.history_turns``);
* by tokens, ``CpMemoryConfig.max_prompt_tokens`` = B: the window grows until the next prompt would not fit B, then
  restarts keeping the most recent turns that fit ``history_restart_keep * B`` (:func:`restart_start`); the store
  keeps only the window (``TurnRecord.trim_before``), so reads stay O(window). See ``cpmemory.session.budgeted``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpmemory.types import Message, Reservation


def window_start(turns: int, max_turns: int | None) -> int:
    """Return how many of the oldest committed turns are left out of the prompt (0 = send them all).

    At most ``max_turns`` turns are kept and the window starts at a multiple of ``max_turns``: once the transcript
    outgrows the window, the window restarts after the last full block of ``max_turns`` turns, keeping between 1
    and ``max_turns`` turns. Between two restarts every turn's history extends the previous one (the engine's prefix
    cache keeps matching it), and right after a restart the history to recompute is a single turn. (A sliding
    window would change the prefix on every turn; restarting every ``max_turns / 2`` turns prefilled more
    in examples/mem0_chat.py; docs/decisions.md.) Pure; O(1).
    """
    if max_turns is None or turns <= max_turns:
        return 0
    return (turns - 1) // max_turns * max_turns


@dataclass(frozen=True, slots=True)
class SentHistory:
    """The history a request sends.

    Attributes:
        messages: the messages, in order.
        stored: True when they are (a window of) the stored transcript, False for a caller-given history.
        dropped_turns: committed turns left out at the front (stored transcript only).
        turns_known: True when every committed turn starts with one user message of ``messages`` (then a block
            committed in turn ``t`` is in the window exactly when ``t > dropped_turns``).
    """

    messages: tuple[Message, ...]
    stored: bool = True
    dropped_turns: int = 0
    turns_known: bool = True


def turn_offsets(reservation: Reservation) -> tuple[list[int], bool]:
    """Message offset of each turn of the reservation's transcript, and whether the turns are known exactly.

    Uses ``turn_sizes`` when the store gives them, else the user messages (a turn starts with one). Pure; O(window).
    """
    transcript = reservation.transcript or ()
    expected = reservation.turn - reservation.transcript_start
    sizes = reservation.turn_sizes
    if sizes and sum(sizes) == len(transcript):
        offsets, at = [], 0
        for size in sizes:
            offsets.append(at)
            at += size
        return offsets, len(sizes) == expected
    starts = [i for i, message in enumerate(transcript) if message["role"] == "user"]
    return starts, len(starts) == expected and (not starts or starts[0] == 0)


def sent_history(
    given: Sequence[Message] | None, reservation: Reservation | None, max_turns: int | None = None
) -> SentHistory:
    """Return the history this request sends: the ``given`` one (the caller's, as dedup reads it), else the stored
    transcript (its last window)."""
    if given is not None:
        return SentHistory(tuple(given), stored=False)
    if reservation is None or reservation.transcript is None:
        return SentHistory(())
    transcript = tuple(reservation.transcript)
    start = reservation.transcript_start
    dropped = max(window_start(reservation.turn, max_turns), start)
    if dropped == 0:
        return SentHistory(transcript)
    offsets, known = turn_offsets(reservation)
    skip = dropped - start
    cut = offsets[skip] if skip < len(offsets) else len(transcript)
    return SentHistory(transcript[cut:], dropped_turns=dropped, turns_known=known)


def restart_start(turn_tokens: Sequence[int], first_turn: int, keep_tokens: int) -> int:
    """Where a restarted window starts: after the oldest turns, keeping the most recent that fit ``keep_tokens``.

    Args:
        turn_tokens: tokens of each turn of the current window, oldest first.
        first_turn: number of committed turns before the window.
        keep_tokens: the most tokens the kept turns may have (0 keeps none).

    Returns:
        The number of committed turns before the new window (at least one more than ``first_turn`` unless the
        window is empty). Pure; O(window).
    """
    kept, total = 0, 0
    for tokens in reversed(turn_tokens):
        if total + tokens > keep_tokens:
            break
        total += tokens
        kept += 1
    kept = min(kept, len(turn_tokens) - 1) if turn_tokens else 0
    return first_turn + len(turn_tokens) - kept
