"""The proxy's hold-and-release queue: while the replicas are full, arriving requests wait a few milliseconds and
are released together, in the window planner's order.

::

    arrival ──► try_admit ── within the bounds and nobody waits ──► run now       (reason "immediate")
                   │
                   └── full, or others already wait ──► held (at most hold_s)
                                                          │
              a request ends and frees room ──────────────┤──► release every held request ("slot")
              the oldest held request waited hold_s ──────┘    ("timeout"), in the planner's order

A replica that already runs as many requests as it can (``max_in_flight``, e.g. vLLM's ``--max-num-seqs``) would
only queue the next ones, first come first served. Holding them in the proxy instead costs at most ``hold_s`` and
lets the facade's window planner (``CpMemory.release_order``) order the waiting requests *together*: a request's
blocks that later waiting requests also hold go first, so those reuse its prefix. The held requests are prepared
(their block order decided) only after their release, which is why the queue sits before ``prepare``.

What the queue counts: requests admitted (immediately or by a release) whose engine call has not ended
(:meth:`Admission.done`). The replica a request runs on is chosen by the router *after* it is prepared (its prompt
decides the prefix score), so the queue cannot know it in advance: it compares the proxy's admitted requests with
``max_in_flight`` times the healthy replicas (one target behind a gateway: the bound is then the fleet's).

A release hands out *every* held request, even past the bound: the hold is a short gathering window, not a second
engine queue (the engine still queues what it cannot run, now in the planner's order). Nothing is ever lost or
starved: a held request waits at most ``hold_s`` (plus the loop's latency); one whose waiter is cancelled (the
client went away) is removed, and one cancelled just after its release gives its slot back. The planner failing
(or missing) releases the window first come first served.

The engine queues a window in the order its requests *reach* it. Released at once, they are prepared and open their
connections side by side, and reach the engine in whatever order that took (measured on two vLLM replicas: a window
of 60 planned LoCoMo questions cached 36% of its prompt tokens, where the same plan in a simulator of the engine's
cache caches 54%). So each released request waits (``Admission.in_turn``) until the one before it in the window
was sent (``Admission.sent``: the engine accepted the call), at most ``SEND_TURN_S`` from the moment that one's own
turn came, and the engine queues the window in the planned order. (Counted from its own release instead, the limit
let every request after the first second of sends go at once: 13-41 of a 62-request window, measured.)

The bound is a count of requests (``max_in_flight`` per healthy replica, what one replica runs at once), a count of
tokens (``token_budget``: what the fleet's KV caches hold, each request counted by its estimated prompt tokens), or
both. vLLM runs a request while its KV blocks fit and queues it otherwise; with prompts of thousands of tokens that,
not ``--max-num-seqs``, is what a replica runs at once (two caches of 17,408 tokens run three 5,800-token LoCoMo
prompts each). The proxy cannot read ``max_num_seqs`` but reads each engine's cache size, so the token bound holds
exactly the requests an engine would have queued without a setting the user must find. It overestimates a window
whose requests share prefixes (vLLM keeps one copy of a shared block): such requests wait for a release where the
engine might have run them, as they would under a count set too low; one request always runs.

A window that outgrows the replicas' caches is also *split* when the planner returns a
:class:`~cpmemory.core.scheduling.ReleasePlan` with lanes (``CpMemory.release_plan``): one contiguous run of the
planned order per replica, even in prefill work, each run in shortest-mean-work order. Each released request then
carries its lane (``Admission.lane``) and the release's :class:`LaneMap`: the first request of a lane to be routed
takes the router's choice among the replicas no other lane of its release holds, and the lane's later requests go
to that replica. Left to the router one by one, a burst of 64 LoCoMo questions went 41 / 23 to two replicas (its
prefix scores follow each unit's first call and its load bound counts calls, not work). Behind a gateway that keeps
a named session on one replica (``upstream_session``, with the replicas' KV events naming how many there are), each
lane is named to it as a session of its own instead.

**Pick per free replica** (``pick``, ``--hold-pick``): instead of handing out the whole window, a replica with room
(``max_in_flight`` a replica, and its share of ``token_budget``) takes *one* held request: first one of the plan
lane that replica already runs (a split plan's contiguous run for one replica stays there, in its order), then the
one whose planned block order finds the longest prefix in what the proxy sent that replica (``pick(replica,
order)``, :class:`~cpmemory.server.pick.SentOrders`), then the plans' order. Requests held since the last plan are
planned together (their block orders, lanes and order) when a replica has room, so arrivals join one plan until
then. Each picked request carries a lane map that names its replica, so
the service sends it there. A request is held at most ``hold_s``: those that waited that long are released
together as a window (planned, and split when it outgrows the caches), as without the pick.
Why: a window released whole queues in the engines in the order planned at its release and the arrivals meanwhile
wait for the next window; picked one at a time, a request is placed when its replica can run it, against what that
replica just computed, with every arrival so far among the choices (``scripts/hold_model.py``). Use from one event
loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from cpmemory.core.blocks import Block
from cpmemory.core.scheduling import ReleasePlan
from cpmemory.server.clock import Clock, LoopClock, Timer

logger = logging.getLogger(__name__)

SEND_TURN_S = 1.0
"""The longest a released request waits for the one before it to be sent once that one's turn came (a slow
preparation, a cache-fit wait)."""
CHAIN_WAIT_S = 30.0
"""The longest a released request waits for the one before it to reach its turn (a safety net: that one waits for
the one before it, each at most ``SEND_TURN_S`` once its turn came)."""

AdmissionReason = Literal["immediate", "slot", "timeout"]
ReleaseOrder = Literal["planner", "fcfs"]

Planner = Callable[[Sequence[Sequence[Block]], str], "Sequence[int] | ReleasePlan"]
"""``planner(requests, tenant)``: the order to run a tenant's waiting requests in (a permutation of their positions),
e.g. ``lambda requests, tenant: memory.release_order(requests, tenant=tenant)``, or a plan with lanes
(``memory.release_plan(requests, tenant=tenant, cache_tokens=..., lanes=...)``)."""


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


class _NullObserver:
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
    _queue: HoldQueue | None = field(default=None, repr=False)
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


@dataclass(slots=True)
class _Held:
    tenant: str
    blocks: tuple[Block, ...]
    tokens: int
    arrived: float
    future: asyncio.Future[Admission]
    order: tuple[Hashable, ...] | None = None  # its planned block order (pick: set when first planned)
    rank: int = 0  # its place in the plans' order (pick)
    lane: tuple[int, int] | None = None  # (its plan, its lane there) when the plan split its window (pick)


PickView = Callable[[int, Sequence[Hashable]], float]
"""``cached(replica, order)``: how much of a planned block order ``replica`` holds as a prefix (a
:class:`~cpmemory.server.pick.SentOrders` view)."""

LANE_CLAIMS = 4096
"""Plan lanes whose replica a pick remembers (the latest)."""


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
        pick: release one held request at a time to a replica with room, the one whose planned block order finds
            the longest prefix ``pick(replica, order)`` says that replica holds (see :meth:`_pick`); None: a
            release hands out every held request (the window). Needs ``planner`` and ``healthy``.
        healthy: the indices of the replicas in rotation (with ``pick``).
        clock: the time and timers (the event loop's by default; a ``ManualClock`` in tests).
    """

    def __init__(self, max_in_flight: int | None, hold_s: float, *, replicas: Callable[[], int] = lambda: 1,
                 token_budget: Callable[[], int | None] | None = None, planner: Planner | None = None,
                 observer: HoldObserver | None = None, pick: PickView | None = None,
                 healthy: Callable[[], Sequence[int]] | None = None, clock: Clock | None = None) -> None:
        if (max_in_flight is not None and max_in_flight < 1) or hold_s <= 0:
            raise ValueError("max_in_flight must be >= 1 and hold_s > 0")
        if max_in_flight is None and token_budget is None:
            raise ValueError("a hold queue needs max_in_flight, token_budget or both")
        if pick is not None and (planner is None or healthy is None):
            raise ValueError("a pick per replica needs a planner and the healthy replicas")
        self._pick_view = pick
        self._clock: Clock = clock or LoopClock()
        self._healthy = healthy or (lambda: (0,))
        self._on: dict[int, list[int]] = {}  # replica -> [requests, tokens] a pick released there, not ended
        self._claims: OrderedDict[tuple[int, int], int] = OrderedDict()  # (plan, lane) -> its replica
        self._plans = 0
        self._ranks = 0
        self.max_in_flight = max_in_flight
        self.hold_s = hold_s
        self._replicas = replicas
        self._token_budget = token_budget
        self._planner = planner
        self._observer: HoldObserver = observer or _NullObserver()
        self._held: list[_Held] = []
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
        """Whether a replica with room takes one held request at a time (``pick``) rather than the whole window."""
        return self._pick_view is not None

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
        entry = _Held(tenant, tuple(blocks), tokens, self._clock.now(), asyncio.get_running_loop().create_future())
        self._held.append(entry)
        if self.picks:
            self._pick(entry)  # a replica with room takes it (or a better one held) at once
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

    def _forget(self, entry: _Held) -> None:
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
        if replica is not None and replica in self._on:
            counts = self._on[replica]
            counts[0], counts[1] = max(0, counts[0] - 1), max(0, counts[1] - tokens)
        if self.picks:
            self._pick()
        elif self._held and not self._full(0):
            self._release("slot")

    def _move(self, old: int, new: int, tokens: int) -> None:
        """A picked request runs on ``new``, not on ``old`` where it was counted."""
        if old in self._on:
            counts = self._on[old]
            counts[0], counts[1] = max(0, counts[0] - 1), max(0, counts[1] - tokens)
        counts = self._on.setdefault(new, [0, 0])
        counts[0] += 1
        counts[1] += tokens
        self._pick()

    def _room(self, replica: int, tokens: int) -> bool:
        """Whether ``replica`` may take one more request of ``tokens``: it runs none of the pick's, or fewer than
        ``max_in_flight`` and their tokens plus these fit its share of ``token_budget``."""
        count, taken = self._on.get(replica, (0, 0))
        if count == 0:
            return True
        if self.max_in_flight is not None and count >= self.max_in_flight:
            return False
        budget = None if self._token_budget is None else self._token_budget()
        return budget is None or taken + tokens <= budget / max(1, len(self._healthy()))

    def _pick(self, arriving: _Held | None = None) -> None:
        """Release held requests, one at a time, to the healthy replicas with room. For each, of the held requests,
        first one of the plan lane that replica already runs (then one of no lane, or of a lane no replica runs
        yet), then the one whose planned block order finds the longest prefix on that replica (``pick``), then the
        plans' order. Lane first: a split plan is the planner's sequence for each replica; taken by the longest
        prefix first, a burst of 64 cached 47.8% against 51.6% in the time model (``scripts/hold_model.py``;
        Poisson arrivals, whose plans rarely split, the same either way). The requests held since the last plan are
        planned together first (the planner's block orders, lanes and order), and only when a replica has room: the
        arrivals until then join one plan.

        Why. Released as a whole window, held requests queue in the engines and are run in the order planned when
        they were released; requests arriving meanwhile wait for the next window. Picked one at a time, each request
        is placed when its replica can run it, against what that replica has just computed, and the requests that
        arrived meanwhile are among the choices (``scripts/hold_model.py``: under Poisson arrivals at twice what the
        original serves, 39% of the prompt tokens cached against 32-33% for windows).

        ``arriving``: the request being admitted, released with reason ``immediate`` when it goes at once."""
        assert self._pick_view is not None
        replicas = list(self._healthy())
        live = [entry for entry in self._held if not entry.future.done()]
        if not live or not any(self._room(replica, 0) for replica in replicas):
            return
        self._plan_fresh([entry for entry in live if entry.order is None])
        while self._held:
            best: tuple[tuple[int, float, int], int, int] | None = None
            for position, entry in enumerate(self._held):
                if entry.future.done():
                    continue  # cancelled: its waiter removes it
                for replica in replicas:
                    if not self._room(replica, entry.tokens):
                        continue
                    claim = None if entry.lane is None else self._claims.get(entry.lane)
                    fit = 2 if claim == replica else int(claim is None)
                    score = (fit, self._pick_view(replica, entry.order or ()), -entry.rank)
                    if best is None or score > best[0]:
                        best = (score, position, replica)
            if best is None:
                break
            _, position, replica = best
            entry = self._held.pop(position)
            if entry.lane is not None:
                self._claims.setdefault(entry.lane, replica)
                self._claims.move_to_end(entry.lane)
                while len(self._claims) > LANE_CLAIMS:
                    self._claims.popitem(last=False)
            lanes = LaneMap()
            lanes.claim(0, replica)
            waited = self._clock.now() - entry.arrived
            counts = self._on.setdefault(replica, [0, 0])
            counts[0] += 1
            counts[1] += entry.tokens
            reason: AdmissionReason = "immediate" if entry is arriving else "slot"
            entry.future.set_result(self._admit_one(Admission(reason, waited, 0, 0, lanes, self,
                                                              _tokens=entry.tokens, _replica=replica)))
            if reason != "immediate":
                self._observer.released(reason, "planner", [waited])
        if not any(not entry.future.done() for entry in self._held):
            self._cancel_timer()

    def _plan_fresh(self, fresh: list[_Held]) -> None:
        """Plan the held requests not planned yet, per tenant, as one window each: their block orders, lanes and
        ranks (a failed plan leaves the blocks in relevance order and arrival ranks)."""
        groups: dict[str, list[_Held]] = {}
        for entry in fresh:
            if entry.blocks:
                groups.setdefault(entry.tenant, []).append(entry)
            else:
                entry.order, entry.rank = (), self._next_rank()
        for tenant, entries in groups.items():
            self._plans += 1
            plan = self._plan(tenant, [entry.blocks for entry in entries])
            if plan is None:
                for entry in entries:
                    entry.order = tuple(block.content_hash for block in entry.blocks)
                    entry.rank = self._next_rank()
                continue
            permutation, lanes, orders = plan
            for position in permutation:
                entry = entries[position]
                entry.order = tuple(orders[position]) if orders else tuple(b.content_hash for b in entry.blocks)
                entry.rank = self._next_rank()
                lane = lanes[position]
                entry.lane = None if lane is None else (self._plans, lane)

    def _next_rank(self) -> int:
        self._ranks += 1
        return self._ranks

    def _expire(self) -> None:
        """The oldest held request waited ``hold_s``: release every held request (the window). With ``pick``,
        only those that waited that long, together, as a window (planned, split over the replicas when it outgrows
        their caches); then wait for the next oldest."""
        self._timer = None
        if not self.picks:
            self._release("timeout")
            return
        now = self._clock.now()
        live = [entry for entry in self._held if not entry.future.done()]
        expired = [entry for entry in live if now - entry.arrived >= self.hold_s - 1e-3]
        self._held = [entry for entry in live if entry not in expired]
        self._release("timeout", expired)
        if self._held:
            oldest = min(entry.arrived for entry in self._held)
            self._timer = self._clock.call_later(max(0.0, oldest + self.hold_s - now), self._expire)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self, reason: AdmissionReason, entries: list[_Held] | None = None) -> None:
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

    def _order(self, window: list[_Held]) -> tuple[list[int], bool, dict[int, tuple[int, LaneMap]]]:
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

