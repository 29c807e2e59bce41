"""Per-tenant context indexes behind a small seam.

The facade keeps one index per tenant (a tenant never sees another tenant's prefixes). The index is
``cpmemory.core.index.ContextIndex`` when that module is importable; otherwise a flat fallback that never finds a
shared prefix (relevance order is kept), so the facade works whatever is installed. Each tenant's index is bounded:
past ``max_leaves`` the oldest request is evicted first (an approximation of the engine's LRU).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class IndexLike(Protocol):
    """The part of ContextIndex the facade uses."""

    def search(self, context: Sequence[Hashable]) -> Any: ...

    def insert(self, context: Sequence[Hashable], request_id: str) -> Any: ...

    def evict(self, request_id: str) -> bool: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _FlatResult:
    path: tuple[int, ...] = ()
    prefix: tuple[Hashable, ...] = ()


class FlatIndex:
    """Fallback index: remembers request ids, never finds a shared prefix."""

    def __init__(self) -> None:
        self._requests: dict[str, tuple[Hashable, ...]] = {}

    def search(self, context: Sequence[Hashable]) -> _FlatResult:
        """Return an empty prefix (keep the relevance order)."""
        return _FlatResult()

    def insert(self, context: Sequence[Hashable], request_id: str) -> _FlatResult:
        """Remember ``request_id`` (mutates)."""
        self._requests[request_id] = tuple(context)
        return _FlatResult()

    def evict(self, request_id: str) -> bool:
        """Forget ``request_id``; False when unknown."""
        return self._requests.pop(request_id, None) is not None

    def __len__(self) -> int:
        return len(self._requests)


def make_index(alpha: float) -> IndexLike:
    """Return a new empty index: CORE's ContextIndex when importable, else the flat fallback."""
    try:
        from cpmemory.core.index import ContextIndex
    except ImportError:
        return FlatIndex()
    return ContextIndex(alpha=alpha)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request landed in its tenant's index."""

    prefix: tuple[Hashable, ...]
    search_path: tuple[int, ...]


class TenantIndexes:
    """One bounded index per tenant, guarded by one lock (index operations are short and CPU-bound)."""

    def __init__(self, alpha: float, max_leaves: int) -> None:
        self._alpha = alpha
        self._max_leaves = max_leaves
        self._lock = threading.Lock()
        self._indexes: dict[str, IndexLike] = {}
        self._requests: dict[str, OrderedDict[str, None]] = {}

    def _index(self, tenant: str) -> IndexLike:
        index = self._indexes.get(tenant)
        if index is None:
            index = self._indexes[tenant] = make_index(self._alpha)
            self._requests[tenant] = OrderedDict()
        return index

    def search(self, tenant: str, context: Sequence[Hashable]) -> tuple[Hashable, ...]:
        """Return the prefix the index holds for ``context`` (no mutation of the tree's shape)."""
        if not context:
            return ()
        with self._lock:
            return tuple(self._index(tenant).search(context).prefix)

    def insert(self, tenant: str, context: Sequence[Hashable], request_id: str) -> tuple[int, ...]:
        """Insert ``context`` as request ``request_id``, evicting the oldest requests past the bound (mutates).

        Returns:
            The search path of the new leaf (empty for the flat fallback or an empty context).
        """
        if not context:
            return ()
        with self._lock:
            index = self._index(tenant)
            result = index.insert(list(context), request_id)
            requests = self._requests[tenant]
            requests[request_id] = None
            while len(requests) > self._max_leaves:
                oldest, _ = requests.popitem(last=False)
                index.evict(oldest)
            return tuple(getattr(result, "path", ()) or ())

    def evict(self, tenant: str, request_ids: Iterable[str]) -> int:
        """Remove the leaves of ``request_ids`` from the tenant's index; return how many existed."""
        with self._lock:
            index = self._indexes.get(tenant)
            if index is None:
                return 0
            requests = self._requests[tenant]
            removed = 0
            for request_id in request_ids:
                requests.pop(request_id, None)
                removed += bool(index.evict(request_id))
            return removed

    def reset(self, tenant: str | None = None) -> None:
        """Drop one tenant's index, or every index when ``tenant`` is None."""
        with self._lock:
            if tenant is None:
                self._indexes.clear()
                self._requests.clear()
            else:
                self._indexes.pop(tenant, None)
                self._requests.pop(tenant, None)

    def size(self, tenant: str) -> int:
        """Number of requests remembered for ``tenant``."""
        with self._lock:
            return len(self._requests.get(tenant, ()))
