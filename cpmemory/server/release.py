"""A released request's handle (:class:`Admission`): its slot, its place in its release's planned sending order,
and the lane of a split window it runs on (cpmemory.server.hold releases them).

The engine queues a window in the order its requests *reach* it. Released at once, they are prepared and open their
connections side by side, and reach the engine in whatever order that took, which loses much of the plan's cached
share (docs/design/admission.md). So each released request waits (:meth:`Admission.in_turn`) until the one before
it in the window was sent (:meth:`Admission.sent`: the engine accepted the call), at most ``SEND_TURN_S`` from the
moment that one's own turn came, and the engine queues the window in the planned order. (Counted from its own
release instead, the limit let every request after the first second of sends go at once.)

A window split over the replicas (a :class:`~cpmemory.core.scheduling.ReleasePlan` with lanes) gives each released
request its lane (``Admission.lane``) and the release's :class:`LaneMap`: the first request of a lane to be routed
takes the router's choice among the replicas no other lane of its release holds, and the lane's later requests go
to that replica; each lane keeps its own sending order. Behind a gateway that keeps a named session on one replica,
each lane is named to it as a session of its own instead. Use from one event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from cpmemory.server.clock import Clock, LoopClock

SEND_TURN_S = 1.0
"""The longest a released request waits for the one before it to be sent once that one's turn came (a slow
preparation, a cache-fit wait)."""
CHAIN_WAIT_S = 30.0
"""The longest a released request waits for the one before it to reach its turn (a safety net: that one waits for
the one before it, each at most ``SEND_TURN_S`` once its turn came)."""

AdmissionReason = Literal["immediate", "slot", "timeout"]
ReleaseOrder = Literal["planner", "fcfs"]


class LaneMap:
    """One release's lanes and the replicas they were given (a lane's first routed request claims one).

    Attributes:
        release: a fresh id of the release (behind a gateway each lane is named to it as a session of its own).
    """

    def __init__(self) -> None:
        self._replicas: dict[int, int] = {}
        self.release = uuid.uuid4().hex

    def session_key(self, lane: int) -> str:
        """The affinity key of ``lane`` of this release (a gateway with session affinity keeps it on one replica)."""
        return f"lane|{self.release}|{lane}"

    def replica(self, lane: int) -> int | None:
        """The replica ``lane`` runs on, None before its first request was routed."""
        return self._replicas.get(lane)

    def claim(self, lane: int, replica: int) -> None:
        """``lane`` runs on ``replica`` from now on (a later claim moves it, e.g. after a failover)."""
        self._replicas[lane] = replica

    def taken(self, lane: int) -> set[int]:
        """The replicas the release's other lanes run on."""
        return {replica for other, replica in self._replicas.items() if other != lane}


class HoldObserver(Protocol):
    """What the queue reports (the proxy's metrics implement it; the default records nothing)."""

    def held(self, waiting: int) -> None:
        """A request started waiting; ``waiting`` are held now."""

    def released(self, reason: AdmissionReason, order: ReleaseOrder, waits_s: Sequence[float]) -> None:
        """A window was released: why, in which order, and how long each of its requests waited."""

    def cancelled(self, waiting: int) -> None:
        """A held request's waiter was cancelled (its client went away); ``waiting`` are held now."""

    def planner_failed(self) -> None:
        """The planner raised or returned something other than a permutation: that window went FCFS."""

    def send_timed_out(self) -> None:
        """A released request waited ``SEND_TURN_S`` for the one before it to be sent and went on without it."""


class NullHoldObserver:
    def held(self, waiting: int) -> None:
        pass

    def released(self, reason: AdmissionReason, order: ReleaseOrder, waits_s: Sequence[float]) -> None:
        pass

    def cancelled(self, waiting: int) -> None:
        pass

    def planner_failed(self) -> None:
        pass

    def send_timed_out(self) -> None:
        pass


class Slots(Protocol):
    """What an admission gives its slot back to (the hold queue)."""

    _observer: HoldObserver
    _clock: Clock

    def _finished(self, tokens: int, replica: int | None = None) -> None:
        """A request's engine call ended: its slot (and its tokens, on ``replica``) are free."""

    def _move(self, old: int, new: int, tokens: int) -> None:
        """A picked request runs on ``new``, not on ``old`` where it was counted."""


@dataclass(slots=True)
class Admission:
    """A request's permission to run. Call :meth:`done` once its engine call has ended (idempotent).

    Attributes:
        reason: ``immediate`` (not held), ``slot`` (released when a request ended) or ``timeout`` (waited hold_s).
        waited_s: how long the request was held.
        position: its place in its release (0 = first sent), 0 when not held.
        lane: the lane of its release's split it runs on (None: not split, the router decides).
        lanes: its release's lanes and their replicas (None when not split).
    """

    reason: AdmissionReason
    waited_s: float = 0.0
    position: int = 0
    lane: int | None = None
    lanes: LaneMap | None = None
    _queue: Slots | None = field(default=None, repr=False)
    _after: asyncio.Event | None = field(default=None, repr=False)  # the previous request of its release was sent
    _sent: asyncio.Event | None = field(default=None, repr=False)
    _after_turn: asyncio.Event | None = field(default=None, repr=False)  # the previous one's turn came
    _turn: asyncio.Event | None = field(default=None, repr=False)
    _tokens: int = field(default=0, repr=False)  # its estimated prompt tokens, counted in flight until done
    _replica: int | None = field(default=None, repr=False)  # the replica a pick released it to (counted there)

    async def in_turn(self, timeout_s: float = SEND_TURN_S) -> None:
        """Wait until the request released before this one (in the window's order; in its lane's, when the window
        was split) has been sent to its engine, at most ``timeout_s``: the engines then queue the window in the
        planned order, where requests released at once and prepared and connected side by side would reach them in
        whatever order their connections opened. A split window's lanes go to different replicas, so each lane
        keeps its own order and none waits for another's sends."""
        if self._turn is not None and self._turn.is_set():
            return  # its turn already came (idempotent)
        clock = self._queue._clock if self._queue is not None else LoopClock()
        try:
            # the one before waits for its own turn first: the limit counts from its turn, not from this one's
            # release, or a window's order would hold only for its first second of sends
            in_order = await _wait_set(self._after_turn, CHAIN_WAIT_S, clock)
            if in_order and not await _wait_set(self._after, timeout_s, clock) and self._queue is not None:
                self._queue._observer.send_timed_out()
        finally:
            if self._turn is not None:
                self._turn.set()

    def sent(self) -> None:
        """The request reached its engine (or will not): the next one of its release may go. Idempotent."""
        if self._turn is not None:
            self._turn.set()
        if self._sent is not None:
            self._sent.set()

    @contextlib.asynccontextmanager
    async def sending(self) -> AsyncIterator[None]:
        """Wait for the request's turn in its release (:meth:`in_turn`), then send it inside the block: leaving it,
        however it ends, lets the next one go (:meth:`sent`)."""
        await self.in_turn()
        try:
            yield
        finally:
            self.sent()

    def placed(self, replica: int) -> None:
        """The request was routed to ``replica``: a pick counts it there from now on (a turn whose conversation
        lives on another replica goes there, whatever replica picked it). Nothing for other admissions."""
        if self._queue is not None and self._replica is not None and replica != self._replica:
            self._queue._move(self._replica, replica, self._tokens)
            self._replica = replica

    def done(self) -> None:
        """The request's engine call ended (or it will not be sent): give its slot back. Idempotent."""
        self.sent()
        queue, self._queue = self._queue, None
        if queue is not None:
            queue._finished(self._tokens, self._replica)


async def _wait_set(event: asyncio.Event | None, timeout_s: float, clock: Clock) -> bool:
    """Wait until ``event`` is set, at most ``timeout_s`` by ``clock``; whether it was set (True for None)."""
    if event is None or event.is_set():
        return True
    expired = asyncio.Event()
    timer = clock.call_later(timeout_s, expired.set)
    setting, expiring = asyncio.ensure_future(event.wait()), asyncio.ensure_future(expired.wait())
    try:
        await asyncio.wait({setting, expiring}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        setting.cancel()
        expiring.cancel()
    return event.is_set()


def unheld() -> Admission:
    """An admission outside any queue (the queue is off); its ``done`` does nothing."""
    return Admission("immediate")
