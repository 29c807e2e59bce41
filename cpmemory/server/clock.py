"""The time admission reads and the timers it sets, behind one seam: the event loop's in the proxy, a manual one
in tests (which step time instead of sleeping) and in simulations of the policies.

``Clock.now()`` is a monotonic time in seconds; ``Clock.call_later(delay, callback, *args)`` runs ``callback`` once,
``delay`` seconds from now, and returns a handle whose ``cancel()`` stops it. The event loop's clock
(:class:`LoopClock`) reads the running loop when called, so one can be made before any loop runs.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any, Protocol


class Timer(Protocol):
    """A pending callback of a :class:`Clock`."""

    def cancel(self) -> None:
        """Stop it (nothing when it already ran or was cancelled)."""


class Clock(Protocol):
    """What admission reads time from and sets timers on."""

    def now(self) -> float:
        """A monotonic time in seconds."""

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Timer:
        """Run ``callback(*args)`` once, ``delay`` seconds from now."""


class LoopClock:
    """The running event loop's clock and timers (the proxy's)."""

    def now(self) -> float:
        """The running loop's time."""
        return asyncio.get_running_loop().time()

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Timer:
        """``loop.call_later`` on the running loop."""
        return asyncio.get_running_loop().call_later(delay, callback, *args)


async def sleep(clock: Clock, seconds: float) -> None:
    """Wait ``seconds`` by ``clock``: like ``asyncio.sleep`` on the loop's clock; on a manual one, until it is
    advanced past them."""
    woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    timer = clock.call_later(seconds, wake)
    try:
        await woken
    finally:
        timer.cancel()


class _ManualTimer:
    __slots__ = ("args", "callback", "cancelled")

    def __init__(self, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.cancelled = False
        self.callback = callback
        self.args = args

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told (:meth:`advance`), running the timers that fall due in time order.

    Args:
        start: the time it starts at.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._order = itertools.count()
        self._timers: list[tuple[float, int, _ManualTimer]] = []

    def now(self) -> float:
        """The time it was moved to."""
        return self._now

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Timer:
        """Run ``callback(*args)`` when :meth:`advance` passes ``now() + delay``."""
        timer = _ManualTimer(callback, args)
        heapq.heappush(self._timers, (self._now + max(0.0, delay), next(self._order), timer))
        return timer

    @property
    def pending(self) -> int:
        """Timers set and neither run nor cancelled."""
        return sum(1 for _, _, timer in self._timers if not timer.cancelled)

    def advance(self, seconds: float) -> None:
        """Move time ``seconds`` on, running every timer due by then (in due order, each at its own time; one a
        callback sets within the step runs too when it falls due)."""
        if seconds < 0:
            raise ValueError("time moves forward only")
        end = self._now + seconds
        while self._timers and self._timers[0][0] <= end:
            due, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, due)
            timer.callback(*timer.args)
        self._now = end
