"""What cache-fit admission hands out and reports: an admitted turn's slot (:class:`FitSlot`), its response header,
and the observer protocol its metrics implement (cpmemory.server.fit decides; this module only carries the result).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

FitReason = Literal["first", "live", "resumed", "moved", "room", "timeout"]
FIT_REASONS: tuple[FitReason, ...] = ("first", "live", "resumed", "moved", "room", "timeout")


class SlotOwner(Protocol):
    """What a slot reports its end to (cache-fit admission)."""

    def _end(self, slot: FitSlot, replica: int | None, prompt_tokens: int | None, answer_tokens: int) -> None:
        """The turn of ``slot`` ended on ``replica`` with the engine's usage."""


class FitObserver(Protocol):
    """What admission reports (the proxy's metrics implement it)."""

    def fit_admitted(self, reason: FitReason, waited_s: float) -> None:
        """A turn was admitted: why, and how long it waited."""

    def fit_waiting(self, waiting: int) -> None:
        """The number of turns waiting changed."""

    def fit_idle_window(self, seconds: float) -> None:
        """The idle window (:meth:`CacheFit.idle_window_s`) after a continuation gap was seen."""


class NullFitObserver:
    def fit_admitted(self, reason: FitReason, waited_s: float) -> None:
        pass

    def fit_waiting(self, waiting: int) -> None:
        pass

    def fit_idle_window(self, seconds: float) -> None:
        pass


@dataclass(slots=True)
class FitSlot:
    """One admitted turn: the replica it goes to; ``end`` (exactly once, idempotent) when its engine call ended."""

    admission: SlotOwner | None
    key: str
    replica: int
    reason: FitReason
    waited_s: float
    chars: int = 0
    _ended: bool = field(default=False, repr=False)

    def end(self, replica: int | None = None, prompt_tokens: int | None = None, answer_tokens: int = 0) -> None:
        """The turn's engine call ended on ``replica`` (None: the admitted one), with the engine's usage when known."""
        if self._ended or self.admission is None:
            return
        self._ended = True
        self.admission._end(self, replica, prompt_tokens, answer_tokens)

    def header(self) -> str:
        """The ``X-Cpmemory-Fit`` value of this turn: ``REASON; wait_ms=W`` (read back by ``parse_fit_header``)."""
        return f"{self.reason}; wait_ms={1000.0 * self.waited_s:.1f}"


UNGATED = FitSlot(None, "", -1, "live", 0.0)
"""The slot of a turn that admission does not gate (off, or behind a gateway without known capacity)."""

FIT_HEADER = "X-Cpmemory-Fit"
"""The streamed response's header naming the reason and wait of a turn that admission gated (absent otherwise)."""


def parse_fit_header(value: str | None) -> tuple[str, float] | None:
    """``REASON; wait_ms=W`` (``FitSlot.header``) as (reason, W); None when absent or not in that form. Pure."""
    if not value:
        return None
    reason, _, rest = value.partition(";")
    key, _, number = rest.strip().partition("=")
    try:
        return (reason.strip(), float(number)) if key == "wait_ms" else None
    except ValueError:
        return None
