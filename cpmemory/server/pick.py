"""What each replica was sent, block by block: the view the hold's pick per free replica scores with
(``--hold-pick``, cpmemory.server.hold).

The hold picks, for a replica with room, the held request whose planned block order finds the longest prefix that
replica caches. Held requests are not prepared yet, so they have no prompt to tokenize and hash as the router's
views do (cpmemory.routing.prefix); they have a planned block order. So this view keeps, per replica, the block
orders of the prompts sent there that open a conversation (the system prompt, then the blocks: the order is then a
prefix the engine caches), as chained prefixes: prefix *i* of an order names its first *i + 1* blocks, and a
request's cached share on a replica is the size of the longest run of its order's prefixes that replica holds.

Like vLLM's cache, each replica's prefixes are bounded by its KV cache (in the unit of the block sizes, characters),
least recently used first, the deepest blocks of an order before its first ones (an engine frees a request's blocks
tail first). It follows what was sent, not the engine's own evictions: a model of the cache, as the window
planner's is (``OnlineOrderer.cached_estimate``). Use from one event loop.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence


class SentOrders:
    """Per replica, the block orders sent there, bounded by its cache, least recently used dropped first.

    Args:
        capacity: the size a replica's cache holds, in the unit of the block sizes (None: unbounded, e.g. while
            the engine's cache size is unknown).
    """

    def __init__(self, capacity: Callable[[int], float | None]) -> None:
        self._capacity = capacity
        self._replicas: dict[int, OrderedDict[int, float]] = {}
        self._totals: dict[int, float] = {}

    @staticmethod
    def _chain(keys: Sequence[Hashable]) -> list[int]:
        chained, parent = [], 0
        for key in keys:
            parent = hash((parent, key))
            chained.append(parent)
        return chained

    def record(self, replica: int, keys: Sequence[Hashable], sizes: Sequence[float]) -> None:
        """A prompt whose blocks ``keys`` (of ``sizes``), in this order, follow the system prompt was sent to
        ``replica``. O(len(keys)) plus what is dropped."""
        if len(keys) != len(sizes):
            raise ValueError("record needs one size per key")
        prefixes = self._replicas.setdefault(replica, OrderedDict())
        total = self._totals.get(replica, 0.0)
        chained = self._chain(keys)
        for prefix, size in zip(reversed(chained), reversed(sizes)):  # the first block ends most recent
            if prefix in prefixes:
                prefixes.move_to_end(prefix)
            else:
                prefixes[prefix] = float(size)
                total += float(size)
        capacity = self._capacity(replica)
        while capacity is not None and total > capacity and prefixes:
            total -= prefixes.popitem(last=False)[1]
        self._totals[replica] = total

    def cached(self, replica: int, keys: Sequence[Hashable]) -> float:
        """The size of the longest prefix of the order ``keys`` that ``replica`` holds. Pure; O(its length)."""
        prefixes = self._replicas.get(replica)
        if not prefixes:
            return 0.0
        found = 0.0
        for prefix in self._chain(keys):
            size = prefixes.get(prefix)
            if size is None:
                break
            found += size
        return found

    def held(self, replica: int) -> float:
        """The size of what ``replica`` holds in this view."""
        return self._totals.get(replica, 0.0)

    def clear(self, replica: int) -> None:
        """Forget what ``replica`` holds (its engine restarted or cleared its cache)."""
        self._replicas.pop(replica, None)
        self._totals.pop(replica, None)
