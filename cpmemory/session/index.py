"""Per-tenant context indexes.

The facade keeps, per tenant (a tenant never sees another tenant's prefixes), one
``cpmemory.core.index.ContextIndex`` (the paper's tree: search paths, leaves tied to request ids, bounded by
``max_leaves``, least recently used leaf evicted first) and one ``cpmemory.core.online.OnlineOrderer`` (the trie of
the orders sent and the retrieval frequencies, which decides the order of a request prepared without
``prompt_order``). An eviction reaches both.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from cpmemory.core.index import ContextIndex
from cpmemory.core.online import OnlineOrderer, window_outgrows
from cpmemory.core.scheduling import ReleasePlan, interleave, split_lanes
from cpmemory.types import SharedOrder

MAX_PLANNED = 4096


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request landed in its tenant's index.

    Attributes:
        prefix: blocks shared with the tree that the request should start with.
        search_path: the path of the request's leaf.
        evicted: request ids the index dropped to stay under its bound.
    """

    prefix: tuple[Hashable, ...] = ()
    search_path: tuple[int, ...] = ()
    evicted: tuple[Hashable, ...] = ()


class TenantIndexes:
    """One bounded index per tenant, guarded by one lock (index operations are short and CPU-bound)."""

    def __init__(self, alpha: float, max_leaves: int) -> None:
        self._alpha = alpha
        self._max_leaves = max_leaves
        self._lock = threading.Lock()
        self._indexes: dict[str, ContextIndex] = {}
        self._orderers: dict[str, OnlineOrderer] = {}
        # Orders decided by release_order for requests about to be prepared: tenant -> block set -> order.
        self._planned: dict[str, OrderedDict[frozenset[Hashable], list[Hashable]]] = {}

    def _orderer(self, tenant: str) -> OnlineOrderer:
        orderer = self._orderers.get(tenant)
        if orderer is None:
            orderer = self._orderers[tenant] = OnlineOrderer(max_requests=self._max_leaves)
        return orderer

    def order(self, tenant: str, context: Sequence[Hashable], sizes: Sequence[float]) -> list[Hashable]:
        """The online order of ``context`` (distinct keys) without recording anything (the request counts in the
        retrieval frequencies only). O(k log k)."""
        if not context:
            return []
        with self._lock:
            orderer = self._orderer(tenant)
            orderer.observe(context)
            return orderer.order(context, sizes)

    def note_tail(self, tenant: str, size: float) -> None:
        """A prompt of ``tenant`` was written with ``size`` characters besides its blocks (``OnlineOrderer.note_tail``:
        the window planner's model of the cache counts it per request)."""
        with self._lock:
            self._orderer(tenant).note_tail(size)

    def release_order(
        self,
        tenant: str,
        contexts: Sequence[Sequence[Hashable]],
        sizes: Sequence[Sequence[float]],
        capacity: float | None = None,
    ) -> list[int]:
        """Plan a window of waiting requests (``OnlineOrderer.plan_window``); return the order to run them in.

        The block orders planned are kept (bounded) and used when these requests are prepared. ``capacity``: the
        engine's prefix cache in the unit of ``sizes`` (None: unknown).
        """
        schedule, _ = self._plan_window(tenant, contexts, sizes, capacity)
        return schedule

    def release_plan(
        self,
        tenant: str,
        contexts: Sequence[Sequence[Hashable]],
        sizes: Sequence[Sequence[float]],
        capacity: float | None,
        lanes: int,
    ) -> ReleasePlan:
        """:meth:`release_order`, and a window that outgrows ``capacity`` (what the ``lanes`` replicas' caches hold
        together) split over the lanes (``cpmemory.core.scheduling.split_lanes``: even work, each lane in
        shortest-mean-work order), sent dealt one from each lane in turn. A window that fits keeps the plain order
        and no lanes (the router's view of what each replica caches places it better). Mutates as
        :meth:`release_order`."""
        schedule, orders = self._plan_window(tenant, contexts, sizes, capacity)
        count = len(contexts)
        planned = tuple(tuple(order) for order in orders)
        if not window_outgrows(sizes, capacity):
            return ReleasePlan(tuple(schedule), (None,) * count, planned)
        filled = [position for position in schedule if contexts[position]]
        weights = {key: size for keys, sized in zip(contexts, sizes) for key, size in zip(keys, sized)}
        with self._lock:
            tail = self._orderer(tenant).tail
        runs = split_lanes([orders[position] for position in filled], weights, lanes, tail)
        lane_of: list[int | None] = [None] * count
        for lane, run in enumerate(runs):
            for index in run:
                lane_of[filled[index]] = lane
        order = [filled[index] for index in interleave(runs)]
        order += [position for position in schedule if not contexts[position]]
        return ReleasePlan(tuple(order), tuple(lane_of), planned)

    def _plan_window(
        self, tenant: str, contexts: Sequence[Sequence[Hashable]], sizes: Sequence[Sequence[float]],
        capacity: float | None,
    ) -> tuple[list[int], list[list[Hashable]]]:
        with self._lock:
            schedule, orders = self._orderer(tenant).plan_window(contexts, sizes, capacity)
            planned = self._planned.setdefault(tenant, OrderedDict())
            for keys, order in zip(contexts, orders):
                if keys:
                    planned[frozenset(keys)] = order
            while len(planned) > MAX_PLANNED:
                planned.popitem(last=False)
        return schedule, orders

    def order_and_place(
        self,
        tenant: str,
        context: Sequence[Hashable],
        sizes: Sequence[float],
        request_id: str,
        shared_order: SharedOrder | None = None,
    ) -> Placement:
        """Order ``context`` online, record the order sent and index it as ``request_id`` (mutates).

        The placement's prefix is the whole order. O(k log k) for the order plus the index insert.

        Args:
            shared_order: the order the tenant's shared decision state gave (Redis), asked for ``context``: used
                instead of the local orderer (which then records nothing; the store records the order at commit).
        """
        if not context:
            return Placement()
        if shared_order is not None:
            ordered: list[Hashable] = list(shared_order.order([str(key) for key in context]))
            with self._lock:
                result = self._index(tenant).insert(ordered, request_id)
            return Placement(tuple(ordered), tuple(result.path), tuple(result.evicted))
        with self._lock:
            orderer = self._orderer(tenant)
            planned = self._planned.get(tenant)
            chosen: list[Hashable] | None = planned.pop(frozenset(context), None) if planned else None
            if chosen is None:  # not planned in a window: order it now
                orderer.observe(context)
                chosen = orderer.order(context, sizes)
            ordered = chosen
            orderer.record(ordered, request_id)
            result = self._index(tenant).insert(ordered, request_id)
            for evicted in result.evicted:
                orderer.evict(evicted)
        return Placement(tuple(ordered), tuple(result.path), tuple(result.evicted))

    def _index(self, tenant: str) -> ContextIndex:
        index = self._indexes.get(tenant)
        if index is None:
            index = self._indexes[tenant] = ContextIndex(alpha=self._alpha, max_leaves=self._max_leaves)
        return index

    def place(self, tenant: str, context: Sequence[Hashable], request_id: str) -> Placement:
        """Insert ``context`` (distinct keys, in the order sent) as request ``request_id`` (mutates).

        The online orderer records the order too (later requests can match it). One tree descent: the insert
        reports the prefix shared with the tree. O(height * |context|).
        """
        if not context:
            return Placement()
        with self._lock:
            orderer = self._orderer(tenant)
            orderer.observe(context)
            orderer.record(context, request_id)
            result = self._index(tenant).insert(list(context), request_id)
            for evicted in result.evicted:
                orderer.evict(evicted)
        return Placement(tuple(result.prefix), tuple(result.path), tuple(result.evicted))

    def evict(self, tenant: str, request_ids: Iterable[str]) -> int:
        """Remove the leaves of ``request_ids`` from the tenant's index; return how many existed."""
        with self._lock:
            index = self._indexes.get(tenant)
            if index is None:
                return 0
            orderer = self._orderers.get(tenant)
            removed = 0
            for request_id in request_ids:
                if orderer is not None:
                    orderer.evict(request_id)
                removed += bool(index.evict(request_id))
            return removed

    def reset(self, tenant: str | None = None) -> None:
        """Drop one tenant's index, or every index when ``tenant`` is None."""
        with self._lock:
            if tenant is None:
                self._indexes.clear()
                self._orderers.clear()
                self._planned.clear()
            else:
                self._indexes.pop(tenant, None)
                self._orderers.pop(tenant, None)
                self._planned.pop(tenant, None)

    def size(self, tenant: str) -> int:
        """Number of requests in ``tenant``'s index."""
        with self._lock:
            index = self._indexes.get(tenant)
            return 0 if index is None else len(index)

    def check_integrity(self, tenant: str) -> None:
        """Run the tenant index's integrity check (raises IndexIntegrityError); no-op for a tenant without one."""
        with self._lock:
            index = self._indexes.get(tenant)
            if index is not None:
                index.check_integrity()
            orderer = self._orderers.get(tenant)
            if orderer is not None:
                orderer.check_integrity()
