"""The ``pick`` hold policy (:class:`PickRelease`, ``--hold pick``) and the view it scores with: what each replica
was sent, block by block (the order index of the fleet's records, :class:`~cpmemory.routing.fleet.SentOrders`).

The hold picks, for a replica with room, the held request whose planned block order finds the longest prefix that
replica caches. Held requests are not prepared yet, so they have no prompt to tokenize and hash as the router's
views do (cpmemory.routing.prefix); they have a planned block order. So this view keeps, per replica, the block
orders of the prompts sent there that open a conversation (the system prompt, then the blocks: the order is then a
prefix the engine caches), as chained prefixes: prefix *i* of an order names its first *i + 1* blocks, and a
request's cached share on a replica is the size of the longest run of its order's prefixes that replica holds.

Like vLLM's cache, each replica's prefixes are bounded by its KV cache (in tokens, cpmemory.routing.fleet),
least recently used first, the deepest blocks of an order before its first ones (an engine frees a request's blocks
tail first). It follows what was sent, not the engine's own evictions: a model of the cache, as the window
planner's is (``OnlineOrderer.cached_estimate``). Use from one event loop.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from cpmemory.routing.fleet import FleetView, SentOrders
from cpmemory.server.release import Admission, AdmissionReason, LaneMap

if TYPE_CHECKING:
    from cpmemory.server.hold import Held, HoldQueue

__all__ = ["LANE_CLAIMS", "PickRelease", "PickView", "SentOrders"]

PickView = Callable[[int, Sequence[Hashable]], float]
"""``cached(replica, order)``: how much of a planned block order ``replica`` holds as a prefix (a
:class:`SentOrders` view)."""

LANE_CLAIMS = 4096
"""Plan lanes whose replica a pick remembers (the latest)."""


class PickRelease:
    """The ``pick`` hold policy: a replica with room takes *one* held request at a time, instead of a whole window.

    For a replica with room (fewer than ``max_in_flight`` of the pick's requests, and its share of the token budget
    when there is one), of the held requests: first one of the plan lane that replica already runs (a split plan's
    contiguous run for one replica stays there, in its order), then the one whose planned block order finds the
    longest prefix in what the proxy sent that replica (``view(replica, order)``, :class:`SentOrders`), then the
    plans' order. Requests held since the last plan are planned together (their block orders, lanes and order) when
    a replica has room, so arrivals join one plan until then. Each picked request carries a lane map that names its
    replica, so the service sends it there. A request is held at most the queue's timeout: those that waited that
    long are released together as a window (planned, and split when it outgrows the caches).

    Why: a window released whole queues in the engines in the order planned at its release and the arrivals
    meanwhile wait for the next window; picked one at a time, a request is placed when its replica can run it,
    against what that replica just computed, with every arrival so far among the choices.

    Args:
        view: ``view(replica, order)``: how much of a planned block order ``replica`` holds as a prefix.
        healthy: the indices of the replicas in rotation.
        fleet: the replicas' records, where the requests and tokens the pick released to each and that have not
            ended are counted (None: a fleet of its own).
    """

    admits_at_once = False

    def __init__(self, view: PickView, healthy: Callable[[], Sequence[int]], fleet: FleetView | None = None
                 ) -> None:
        self._view = view
        self._healthy = healthy
        self._fleet = fleet if fleet is not None else FleetView(0)
        self._claims: OrderedDict[tuple[int, int], int] = OrderedDict()  # (plan, lane) -> its replica
        self._plans = 0
        self._ranks = 0

    def arrived(self, queue: HoldQueue, entry: Held) -> None:
        """A request was held: a replica with room takes it (or a better one held) at once."""
        self._take(queue, entry)

    def finished(self, queue: HoldQueue, tokens: int, replica: int | None) -> None:
        """A request of the pick ended on ``replica``: that replica may take the next."""
        if replica is not None:
            self._fleet.unpicked(replica, tokens)
        self._take(queue)

    def moved(self, queue: HoldQueue, old: int, new: int, tokens: int) -> None:
        """A picked request runs on ``new``, not on ``old`` where it was counted."""
        self._fleet.unpicked(old, tokens)
        self._fleet.picked(new, tokens)
        self._take(queue)

    def expired(self, queue: HoldQueue) -> None:
        """The oldest held request waited the timeout: those that waited that long go together as a window; then
        the timer waits for the next oldest."""
        now = queue._clock.now()
        live = [entry for entry in queue._held if not entry.future.done()]
        expired = [entry for entry in live if now - entry.arrived >= queue.hold_s - 1e-3]
        queue._held = [entry for entry in live if entry not in expired]
        queue._release("timeout", expired)
        if queue._held:
            oldest = min(entry.arrived for entry in queue._held)
            queue._timer = queue._clock.call_later(max(0.0, oldest + queue.hold_s - now), queue._expire)

    def _room(self, queue: HoldQueue, replica: int, tokens: int) -> bool:
        """Whether ``replica`` may take one more request of ``tokens``: it runs none of the pick's, or fewer than
        ``max_in_flight`` and their tokens plus these fit its share of the token budget."""
        record = self._fleet.record(replica)
        count, taken = record.picked, record.picked_tokens
        if count == 0:
            return True
        if queue.max_in_flight is not None and count >= queue.max_in_flight:
            return False
        budget = None if queue._token_budget is None else queue._token_budget()
        return budget is None or taken + tokens <= budget / max(1, len(self._healthy()))

    def _best(self, queue: HoldQueue, replicas: Sequence[int]) -> tuple[int, int] | None:
        """The (held position, replica) to release next: lane first, then the longest cached prefix, then rank."""
        best: tuple[tuple[int, float, int], int, int] | None = None
        for position, entry in enumerate(queue._held):
            if entry.future.done():
                continue  # cancelled: its waiter removes it
            for replica in replicas:
                if not self._room(queue, replica, entry.tokens):
                    continue
                claim = None if entry.lane is None else self._claims.get(entry.lane)
                fit = 2 if claim == replica else int(claim is None)
                score = (fit, self._view(replica, entry.order or ()), -entry.rank)
                if best is None or score > best[0]:
                    best = (score, position, replica)
        return None if best is None else (best[1], best[2])

    def _take(self, queue: HoldQueue, arriving: Held | None = None) -> None:
        """Release held requests, one at a time, to the healthy replicas with room (see the class). ``arriving``:
        the request being admitted, released with reason ``immediate`` when it goes at once."""
        replicas = list(self._healthy())
        live = [entry for entry in queue._held if not entry.future.done()]
        if not live or not any(self._room(queue, replica, 0) for replica in replicas):
            return
        self._plan_fresh(queue, [entry for entry in live if entry.order is None])
        while queue._held:
            chosen = self._best(queue, replicas)
            if chosen is None:
                break
            position, replica = chosen
            entry = queue._held.pop(position)
            if entry.lane is not None:
                self._claims.setdefault(entry.lane, replica)
                self._claims.move_to_end(entry.lane)
                while len(self._claims) > LANE_CLAIMS:
                    self._claims.popitem(last=False)
            lanes = LaneMap()
            lanes.claim(0, replica)
            waited = queue._clock.now() - entry.arrived
            self._fleet.picked(replica, entry.tokens)
            reason: AdmissionReason = "immediate" if entry is arriving else "slot"
            entry.future.set_result(queue._admit_one(Admission(reason, waited, 0, 0, lanes, queue,
                                                               _tokens=entry.tokens, _replica=replica)))
            if reason != "immediate":
                queue._observer.released(reason, "planner", [waited])
        if not any(not entry.future.done() for entry in queue._held):
            queue._cancel_timer()

    def _plan_fresh(self, queue: HoldQueue, fresh: list[Held]) -> None:
        """Plan the held requests not planned yet, per tenant, as one window each: their block orders, lanes and
        ranks (a failed plan leaves the blocks in relevance order and arrival ranks)."""
        groups: dict[str, list[Held]] = {}
        for entry in fresh:
            if entry.blocks:
                groups.setdefault(entry.tenant, []).append(entry)
            else:
                entry.order, entry.rank = (), self._next_rank()
        for tenant, entries in groups.items():
            self._plans += 1
            plan = queue._plan(tenant, [entry.blocks for entry in entries])
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
