"""Per-tenant context indexes.

The facade keeps one ``cpmemory.core.index.ContextIndex`` per tenant (a tenant never sees another tenant's
prefixes), each bounded by ``max_leaves`` (the index evicts its least recently used leaf).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from cpmemory.core.index import ContextIndex


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

    def _index(self, tenant: str) -> ContextIndex:
        index = self._indexes.get(tenant)
        if index is None:
            index = self._indexes[tenant] = ContextIndex(alpha=self._alpha, max_leaves=self._max_leaves)
        return index

    def place(self, tenant: str, context: Sequence[Hashable], request_id: str) -> Placement:
        """Insert ``context`` (distinct keys, relevance order) as request ``request_id`` (mutates).

        One tree descent: the insert reports the prefix the request should start with. O(height * |context|).
        """
        if not context:
            return Placement()
        with self._lock:
            result = self._index(tenant).insert(list(context), request_id)
        return Placement(tuple(result.prefix), tuple(result.path), tuple(result.evicted))

    def evict(self, tenant: str, request_ids: Iterable[str]) -> int:
        """Remove the leaves of ``request_ids`` from the tenant's index; return how many existed."""
        with self._lock:
            index = self._indexes.get(tenant)
            if index is None:
                return 0
            return sum(bool(index.evict(request_id)) for request_id in request_ids)

    def reset(self, tenant: str | None = None) -> None:
        """Drop one tenant's index, or every index when ``tenant`` is None."""
        with self._lock:
            if tenant is None:
                self._indexes.clear()
            else:
                self._indexes.pop(tenant, None)

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
