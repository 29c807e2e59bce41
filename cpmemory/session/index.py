"""Per-tenant context indexes behind a small seam.

The facade keeps one index per tenant (a tenant never sees another tenant's prefixes). The index is
``cpmemory.core.index.ContextIndex`` when that module is importable; otherwise a flat fallback that never finds a
shared prefix (relevance order is kept), so the facade works whatever is installed. Each tenant's index is bounded
by ``max_leaves`` (ContextIndex evicts its least recently used leaf; the fallback its oldest request).
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
    evicted: tuple[Hashable, ...] = ()


class FlatIndex:
    """Fallback index: remembers request ids (oldest dropped past ``max_leaves``), never finds a shared prefix."""

    def __init__(self, max_leaves: int | None = None) -> None:
        self._requests: OrderedDict[Hashable, tuple[Hashable, ...]] = OrderedDict()
        self._max_leaves = max_leaves

    def search(self, context: Sequence[Hashable]) -> _FlatResult:
        """Return an empty prefix (keep the relevance order)."""
        return _FlatResult()

    def insert(self, context: Sequence[Hashable], request_id: str) -> _FlatResult:
        """Remember ``request_id`` (mutates), dropping the oldest requests past the cap."""
        self._requests[request_id] = tuple(context)
        evicted: list[Hashable] = []
        while self._max_leaves is not None and len(self._requests) > self._max_leaves:
            evicted.append(self._requests.popitem(last=False)[0])
        return _FlatResult(evicted=tuple(evicted))

    def evict(self, request_id: str) -> bool:
        """Forget ``request_id``; False when unknown."""
        return self._requests.pop(request_id, None) is not None

    def __len__(self) -> int:
        return len(self._requests)


def make_index(alpha: float, max_leaves: int | None = None) -> IndexLike:
    """Return a new empty index: CORE's ContextIndex when importable, else the flat fallback."""
    try:
        from cpmemory.core.index import ContextIndex
    except ImportError:
        return FlatIndex(max_leaves)
    return ContextIndex(alpha=alpha, max_leaves=max_leaves)


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
        self._indexes: dict[str, IndexLike] = {}

    def _index(self, tenant: str) -> IndexLike:
        index = self._indexes.get(tenant)
        if index is None:
            index = self._indexes[tenant] = make_index(self._alpha, self._max_leaves)
        return index

    def place(self, tenant: str, context: Sequence[Hashable], request_id: str) -> Placement:
        """Insert ``context`` (distinct keys, relevance order) as request ``request_id`` (mutates).

        One tree descent: the insert reports the prefix the request should start with. O(height * |context|).
        """
        if not context:
            return Placement()
        with self._lock:
            result = self._index(tenant).insert(list(context), request_id)
        return Placement(
            tuple(getattr(result, "prefix", ()) or ()),
            tuple(getattr(result, "path", ()) or ()),
            tuple(getattr(result, "evicted", ()) or ()),
        )

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
        """Run the tenant index's own integrity check when it has one (raises IndexIntegrityError)."""
        with self._lock:
            index = self._indexes.get(tenant)
            check = getattr(index, "check_integrity", None)
            if check is not None:
                check()
