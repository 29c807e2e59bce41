"""The proxy's hold queue: while the replicas are full, arriving requests wait and are released in the window
planner's order, by one of two policies (``--hold window|pick``; ``off``: no queue).

::

    arrival ──► try_admit ── within the bounds and nobody waits ──► run now       (reason "immediate")
                   │
                   └── full, or others already wait ──► held (at most hold_s)
                                                          │
              a request ends and frees room ──────────────┤──► release by the policy ("slot")
              the oldest held request waited hold_s ──────┘    ("timeout"), in the planner's order

A replica that already runs as many requests as it can would only queue the next ones, first come first served.
Holding them in the proxy instead costs at most ``hold_s`` and lets the facade's window planner
(``CpMemory.release_order``) order the waiting requests *together*: a request's blocks that later waiting requests
also hold go first, so those reuse its prefix. The held requests are prepared (their block order decided) only after
their release, which is why the queue sits before ``prepare``.

What the queue counts: requests admitted (immediately or by a release) whose engine call has not ended
(:meth:`Admission.done`). The bound is a count of requests (``max_in_flight`` per healthy replica: the replica a
request runs on is chosen by the router *after* it is prepared, so the queue compares the proxy's admitted requests
with ``max_in_flight`` times the healthy replicas), a count of tokens (``token_budget``: what the fleet's KV caches
hold, each request counted by its estimated prompt tokens), or both. vLLM runs a request while its KV blocks fit and
queues it otherwise; with prompts of thousands of tokens that, not ``--max-num-seqs``, is what a replica runs at
once, so the token bound holds exactly the requests an engine would have queued, without a setting the user must
find. It overestimates a window whose requests share prefixes (vLLM keeps one copy of a shared block); one request
always runs.

The policies (:class:`ReleasePolicy`):

* **window** (:class:`WindowRelease`): a release hands out *every* held request, even past the bound: the hold is a
  short gathering window, not a second engine queue (the engine still queues what it cannot run, now in the
  planner's order). A window that outgrows the replicas' caches is *split* when the planner returns a
  :class:`~cpmemory.core.scheduling.ReleasePlan` with lanes: one contiguous run of the planned order per replica
  (cpmemory.server.release sends each run in its order).
* **pick** (:class:`~cpmemory.server.pick.PickRelease`): a replica with room takes one held request at a time.

Nothing is ever lost or starved: a held request waits at most ``hold_s`` (plus the loop's latency); one whose waiter
is cancelled (the client went away) is removed, and one cancelled just after its release gives its slot back. The
planner failing (or missing) releases the window first come first served. Time and timers come from a
:class:`~cpmemory.server.clock.Clock`. Use from one event loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cpmemory.core.blocks import Block
from cpmemory.core.scheduling import ReleasePlan
from cpmemory.server.clock import Clock, LoopClock, Timer
from cpmemory.server.release import (  # noqa: F401 - the released request's handle, re-exported
    CHAIN_WAIT_S,
    SEND_TURN_S,
    Admission,
    AdmissionReason,
    HoldObserver,
    LaneMap,
    NullHoldObserver,
    ReleaseOrder,
    unheld,
)

logger = logging.getLogger(__name__)

Planner = Callable[[Sequence[Sequence[Block]], str], "Sequence[int] | ReleasePlan"]
"""``planner(requests, tenant)``: the order to run a tenant's waiting requests in (a permutation of their positions),
e.g. ``lambda requests, tenant: memory.release_order(requests, tenant=tenant)``, or a plan with lanes
(``memory.release_plan(requests, tenant=tenant, cache_tokens=..., lanes=...)``)."""


@dataclass(slots=True)
class Held:
    """A held request (the policies read and plan it)."""

    tenant: str
    blocks: tuple[Block, ...]
    tokens: int
    arrived: float
    future: asyncio.Future[Admission]
    order: tuple[Hashable, ...] | None = None  # its planned block order (pick: set when first planned)
    rank: int = 0  # its place in the plans' order (pick)
    lane: tuple[int, int] | None = None  # (its plan, its lane there) when the plan split its window (pick)


class ReleasePolicy(Protocol):
    """When held requests go: what a hold policy does at each event of the queue."""

    admits_at_once: bool
    """Whether a request within the bounds runs at once when nobody is held (else every one goes by the policy)."""

    def arrived(self, queue: HoldQueue, entry: Held) -> None:
        """``entry`` was just held."""

    def finished(self, queue: HoldQueue, tokens: int, replica: int | None) -> None:
        """A request's engine call ended (its slot is already free in ``queue``)."""

    def moved(self, queue: HoldQueue, old: int, new: int, tokens: int) -> None:
        """A released request runs on replica ``new``, not ``old``."""

    def expired(self, queue: HoldQueue) -> None:
        """The oldest held request waited ``hold_s``."""


class WindowRelease:
    """The ``window`` hold policy: a freed slot or the oldest request's timeout releases every held request, as one
    window in the planner's order."""

    admits_at_once = True

    def arrived(self, queue: HoldQueue, entry: Held) -> None:
        """Nothing: the request waits for a slot or the window's timeout."""

    def finished(self, queue: HoldQueue, tokens: int, replica: int | None) -> None:
        """A slot is free: release the window if the bounds allow one more request."""
        if queue._held and not queue._full(0):
            queue._release("slot")

    def moved(self, queue: HoldQueue, old: int, new: int, tokens: int) -> None:
        """Nothing: the window's bounds are the fleet's, not a replica's."""

    def expired(self, queue: HoldQueue) -> None:
        """Release every held request."""
        queue._release("timeout")


class HoldQueue:
    """Holds requests while the replicas are full and releases them in planner order. See the module docstring.

    Args:
        max_in_flight: requests one replica can run at once; None: no count bound (``token_budget`` then bounds).
        hold_s: the longest a request is held.
        replicas: how many replicas are healthy now (the bound is ``max_in_flight`` times that, at least one).
        token_budget: the tokens the requests in flight may take together (the fleet's KV cache), None while
            unknown (no token bound then); each request counts the ``tokens`` it was admitted with.
        planner: orders a tenant's waiting requests; None releases first come first served.
        observer: receives the queue's events (metrics).
        policy: when held requests go (:class:`WindowRelease` by default; ``PickRelease`` needs ``planner``).
        clock: the time and timers (the event loop's by default; a ``ManualClock`` in tests).
    """

    def __init__(self, max_in_flight: int | None, hold_s: float, *, replicas: Callable[[], int] = lambda: 1,
                 token_budget: Callable[[], int | None] | None = None, planner: Planner | None = None,
                 observer: HoldObserver | None = None, policy: ReleasePolicy | None = None,
                 clock: Clock | None = None) -> None:
        if (max_in_flight is not None and max_in_flight < 1) or hold_s <= 0:
            raise ValueError("max_in_flight must be >= 1 and hold_s > 0")
        if max_in_flight is None and token_budget is None:
            raise ValueError("a hold queue needs max_in_flight, token_budget or both")
        self._policy: ReleasePolicy = policy or WindowRelease()
        if not self._policy.admits_at_once and planner is None:
            raise ValueError("a pick per replica needs a planner")
        self._clock: Clock = clock or LoopClock()
        self.max_in_flight = max_in_flight
        self.hold_s = hold_s
        self._replicas = replicas
        self._token_budget = token_budget
        self._planner = planner
        self._observer: HoldObserver = observer or NullHoldObserver()
        self._held: list[Held] = []
        self._admitted = 0
        self._tokens = 0
        self._timer: Timer | None = None

    @property
    def admitted(self) -> int:
        """Requests admitted whose engine call has not ended."""
        return self._admitted

    @property
    def waiting(self) -> int:
        """Requests held now."""
        return len(self._held)

    @property
    def counts_tokens(self) -> bool:
        """Whether the queue has a token bound (callers then pass each request's estimated prompt tokens)."""
        return self._token_budget is not None

    @property
    def tokens(self) -> int:
        """The estimated prompt tokens of the requests admitted whose engine call has not ended."""
        return self._tokens

    def capacity(self) -> int | None:
        """``max_in_flight`` times the healthy replicas (at least one replica's worth); None without a count bound."""
        return None if self.max_in_flight is None else self.max_in_flight * max(1, self._replicas())

    def _full(self, tokens: int) -> bool:
        """Whether one more request of ``tokens`` would pass a bound (never while nothing is in flight)."""
        if self._admitted == 0:
            return False
        capacity = self.capacity()
        if capacity is not None and self._admitted >= capacity:
            return True
        budget = None if self._token_budget is None else self._token_budget()
        return budget is not None and self._tokens + tokens > budget

    @property
    def picks(self) -> bool:
        """Whether every request goes by the policy (``pick``: a replica with room takes one held request at a
        time) rather than at once while within the bounds."""
        return not self._policy.admits_at_once

    def try_admit(self, tokens: int = 0) -> Admission | None:
        """Admit a request of ``tokens`` (estimated prompt tokens) now if it is within the bounds and nobody is
        held (held ones are never overtaken). O(1). With ``pick`` always None: every request goes through
        :meth:`admit`, where a replica with room picks it at once."""
        if self._held or self._full(tokens) or self.picks:
            return None
        return self._admit_one(Admission("immediate", _queue=self, _tokens=tokens))

    def _admit_one(self, admission: Admission) -> Admission:
        self._admitted += 1
        self._tokens += admission._tokens
        return admission

    async def admit(self, tenant: str, blocks: Sequence[Block] = (), tokens: int = 0) -> Admission:
        """Admit a request: at once when it is within the bounds, else after it was held (at most ``hold_s``).

        Args:
            tenant: whose index plans the request's window.
            blocks: the request's blocks (none for a plain request: it keeps its place, first come first served).
            tokens: its estimated prompt tokens (what it takes of ``token_budget`` while in flight).

        A cancelled waiter leaves the queue (nothing to undo); one released but cancelled before it resumed gives
        its slot back.
        """
        admission = self.try_admit(tokens)
        if admission is not None:
            return admission
        entry = Held(tenant, tuple(blocks), tokens, self._clock.now(), asyncio.get_running_loop().create_future())
        self._held.append(entry)
        self._policy.arrived(self, entry)
        if entry.future.done():
            return entry.future.result()
        if self._timer is None:  # the oldest held request sets the deadline of the whole window
            self._timer = self._clock.call_later(self.hold_s, self._expire)
        self._observer.held(len(self._held))
        try:
            return await entry.future
        except asyncio.CancelledError:
            self._forget(entry)
            raise

    def _forget(self, entry: Held) -> None:
        if entry in self._held:
            self._held.remove(entry)
            if not self._held:
                self._cancel_timer()
        elif entry.future.done() and not entry.future.cancelled():
            entry.future.result().done()  # released, but its request will not run
        self._observer.cancelled(len(self._held))

    def _finished(self, tokens: int, replica: int | None = None) -> None:
        self._admitted = max(0, self._admitted - 1)
        self._tokens = max(0, self._tokens - tokens)
        self._policy.finished(self, tokens, replica)

    def _move(self, old: int, new: int, tokens: int) -> None:
        """A released request runs on ``new``, not on ``old`` where it was counted."""
        self._policy.moved(self, old, new, tokens)

    def _expire(self) -> None:
        """The oldest held request waited ``hold_s``: the policy releases (every held request, or those that
        waited that long)."""
        self._timer = None
        self._policy.expired(self)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self, reason: AdmissionReason, entries: list[Held] | None = None) -> None:
        """Release every held request (or only ``entries``, with the timer left to the caller), in planner order
        (the futures resolve in that order, so their tasks resume, are prepared and are sent in that order)."""
        if entries is None:
            self._cancel_timer()
            entries, self._held = self._held, []
        window = [entry for entry in entries if not entry.future.done()]
        if not window:
            return
        order, planned, lanes = self._order(window)
        now = self._clock.now()
        waits = []
        # per lane (None: the requests not split), the last one's (turn, sent) events
        last: dict[tuple[int, int] | None, tuple[asyncio.Event, asyncio.Event]] = {}
        for position, index in enumerate(order):
            entry = window[index]
            waits.append(now - entry.arrived)
            turn, sent = asyncio.Event(), asyncio.Event()
            lane, lane_map = lanes.get(index, (None, None))
            chain = None if lane_map is None or lane is None else (id(lane_map), lane)
            previous_turn, previous = last.get(chain, (None, None))
            entry.future.set_result(self._admit_one(Admission(reason, waits[-1], position, lane, lane_map, self,
                                                              previous, sent, previous_turn, turn, entry.tokens)))
            last[chain] = (turn, sent)
        self._observer.released(reason, "planner" if planned else "fcfs", waits)

    def _order(self, window: list[Held]) -> tuple[list[int], bool, dict[int, tuple[int, LaneMap]]]:
        """The release order of ``window``: each tenant's requests with blocks are ordered by the planner among
        the positions they hold; the rest keep their arrival positions. Returns (order, whether planned, the lane
        and lane map of each request of a split tenant window, by its window index)."""
        order = list(range(len(window)))
        lanes: dict[int, tuple[int, LaneMap]] = {}
        if self._planner is None:
            return order, False, lanes
        groups: dict[str, list[int]] = {}
        for index, entry in enumerate(window):
            if entry.blocks:
                groups.setdefault(entry.tenant, []).append(index)
        planned = False
        failed = False
        for tenant, positions in groups.items():
            if len(positions) < 2:
                continue  # nothing to order: prepare orders a lone request itself
            plan = self._plan(tenant, [window[index].blocks for index in positions])
            if plan is None:
                failed = True
                continue
            permutation, plan_lanes, _ = plan
            for slot, chosen in zip(positions, permutation):
                order[slot] = positions[chosen]
            if any(lane is not None for lane in plan_lanes):
                lane_map = LaneMap()
                for position, lane in zip(positions, plan_lanes):
                    if lane is not None:
                        lanes[position] = (lane, lane_map)
            planned = True
        return order, planned and not failed, lanes

    def _plan(self, tenant: str, requests: list[tuple[Block, ...]]
              ) -> tuple[list[int], Sequence[int | None], Sequence[Sequence[Hashable]]] | None:
        """The planner's permutation, lanes (None each when it gave a plain order) and block orders (empty when it
        gave none); None when it failed."""
        assert self._planner is not None
        planned: Sequence[Sequence[Hashable]] = ()
        try:
            result = self._planner(requests, tenant)
            if isinstance(result, ReleasePlan):
                permutation, lanes = [int(position) for position in result.order], result.lanes
                planned = result.orders if len(result.orders) == len(requests) else ()
            else:
                permutation, lanes = [int(position) for position in result], (None,) * len(requests)
        except Exception as error:  # noqa: BLE001 - any planner failure means first come first served
            logger.warning("hold queue: the planner failed (%s); releasing in arrival order", error)
            self._observer.planner_failed()
            return None
        if sorted(permutation) != list(range(len(requests))) or len(lanes) != len(requests):
            logger.warning("hold queue: the planner returned no permutation; releasing in arrival order")
            self._observer.planner_failed()
            return None
        return permutation, lanes, planned

