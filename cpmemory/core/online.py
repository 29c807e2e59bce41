"""The online orderer: how a request's blocks are ordered when it arrives, one at a time (no batch, no future).

It keeps a trie of the block orders already sent (a block-level mirror of the engine's prefix cache: an order sent
is cached as a path from the root), how often each block was retrieved so far, and for each block the last
``POSTING_LENGTH`` requests that retrieved it. A request's order is:

1. **Match**: the path of the trie, restricted to the request's blocks, that maximises the weighted tokens it
   would find cached: each block on it counts its size times a recency weight ``1 / (1 + age / RECENCY_SCALE)``
   (``age`` = requests sent since the trie node was last used). A long path used recently is likely still cached;
   an old one was likely evicted. Taking the deepest such path (not the most travelled child at each step) reuses
   more of what the cache holds; the recency weight keeps a tight cache from being chased into evicted branches.
2. **Extend by co-occurrence**: the next block is the one, among those left, that the earlier requests holding
   every block placed so far retrieved most often, token-weighted: ``size * (count + p) / (holders + 1)``, the
   share of those ``holders`` that retrieved it, smoothed toward ``p``, its retrieval frequency so far (additive
   smoothing with the popularity as the prior: with few such requests the order leans on popularity). The set of
   holders narrows at each step. These are the requests most like this one; a later request like them holds the
   same blocks, so it finds this order's prefix cached. With nothing placed yet, the first block goes by
   ``size * p / (1 - p)`` (for independent draws the order that maximises the tokens a future request shares, by
   an exchange argument on adjacent blocks). Ties: the block first retrieved earliest, then the relevance order.
3. **Keep the relevance order** once no earlier request holds every block placed (nobody is known to share a
   longer prefix): the rule of the offline planner for unshared tails, which also spares order annotations.

The chosen order is then recorded (:meth:`OnlineOrderer.record`) along the trie with the request id, so an
eviction reported by the engine (:meth:`OnlineOrderer.evict`) takes the request's weight off its path, and nodes
no request holds any more are removed. Bounded: at most ``max_requests`` recorded requests (the oldest is
forgotten first), ``max_blocks`` frequency entries (counts are halved when full) and ``POSTING_LENGTH`` requests
per block.

Cost per request: the match visits at most ``MATCH_BUDGET`` trie nodes with one dict lookup per block of the
request at each (``O(k * visited)``, independent of the number of requests indexed), the extension intersects at
most ``k`` postings of ``POSTING_LENGTH`` requests per step (``O(k^2 * POSTING_LENGTH)`` set work; in practice the
set of holders shrinks to a few requests after two steps), and recording walks ``k`` nodes.

Not thread-safe: the facade serialises access (one orderer per tenant, behind the tenant indexes' lock).
"""

from __future__ import annotations

import contextlib
import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence

from cpmemory.errors import InvalidInputError

RECENCY_SCALE = 50.0
MATCH_BUDGET = 64
POSTING_LENGTH = 16
TAIL_SMOOTHING = 0.1
"""Weight of the newest prompt in the running mean of the prompts' own tails (:meth:`OnlineOrderer.note_tail`)."""
WINDOW_RATCHET_STEPS = 0
"""Local-search ratchet rounds of the batch plan of a window that outgrows the cache (``plan_window``): the offline
default's rounds gain little share for several times the planning time, which the window cannot wait for."""


class _TrieNode:
    """One block of a sent order. ``count``: recorded requests through it; ``last``: clock of its last use."""

    __slots__ = ("children", "count", "key", "last", "parent")

    def __init__(self, key: Hashable, parent: _TrieNode | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, _TrieNode] = {}
        self.count = 0
        self.last = 0


class OnlineOrderer:
    """Per-tenant online block ordering (see the module docstring). Mutating methods say so."""

    def __init__(self, max_requests: int = 100_000, max_blocks: int = 1_000_000) -> None:
        if max_requests < 1 or max_blocks < 1:
            raise InvalidInputError("max_requests and max_blocks must be positive")
        self.max_requests = max_requests
        self.max_blocks = max_blocks
        self._root = _TrieNode(None, None)
        self._clock = 0
        self._requests_seen = 0
        self._frequency: Counter[Hashable] = Counter()
        self._first_seen: dict[Hashable, int] = {}
        self._postings: dict[Hashable, list[int]] = {}  # block -> ordinals of the last requests that retrieved it
        self._paths: OrderedDict[Hashable, _TrieNode] = OrderedDict()  # request id -> last node of its order
        self._sizes: dict[Hashable, float] = {}  # block -> its size, as last given (the cache model's weights)
        self._tail: float | None = None  # running mean of what a prompt adds besides its blocks (note_tail)

    def __len__(self) -> int:
        """Number of recorded requests."""
        return len(self._paths)

    # ------------------------------------------------------------------------------------------------ decisions
    def observe(self, keys: Sequence[Hashable]) -> int:
        """Count one arrived request's blocks in the retrieval frequencies and postings (mutates). O(k).

        Returns the request's ordinal (what :meth:`order` leaves out of the co-occurrence counts: its own).
        """
        self._requests_seen += 1
        frequency, first, postings, ordinal = self._frequency, self._first_seen, self._postings, self._requests_seen
        for key in keys:
            frequency[key] += 1
            if key not in first:
                first[key] = ordinal  # the request that first retrieved it (ties: the request's own order)
            posting = postings.get(key)
            if posting is None:
                postings[key] = [ordinal]
            else:
                posting.append(ordinal)
                if len(posting) > POSTING_LENGTH:
                    del posting[0]
        if len(frequency) > self.max_blocks:
            self._halve_frequencies()
        return ordinal

    def order(self, keys: Sequence[Hashable], sizes: Sequence[float], own: int | None = None) -> list[Hashable]:
        """The order to send ``keys`` (distinct) in, given each block's size (tokens or characters). Pure.

        Args:
            own: the request's ordinal from :meth:`observe` (default: the last request observed), left out of
                the co-occurrence counts.
        """
        if len(keys) != len(sizes):
            raise InvalidInputError("order needs one size per key")
        size = dict(zip(keys, sizes))
        path = self.match(size)
        placed = set(path)
        rest = [key for key in keys if key not in placed]
        return path + self._extension(rest, size, path, self._requests_seen if own is None else own)

    def match(self, size: dict[Hashable, float]) -> list[Hashable]:
        """The recorded path (restricted to the keys of ``size``) with the most recency-weighted size. Pure.

        Depth-first branch and bound: children are tried best first, and a branch is cut when even caching all
        the request's blocks not yet on it at full weight could not beat the best path found. At most
        ``MATCH_BUDGET`` nodes are expanded.
        """
        clock, best_score, best_node = self._clock, 0.0, self._root
        budget = MATCH_BUDGET
        stack: list[tuple[_TrieNode, float, float]] = [(self._root, 0.0, sum(size.values()))]
        while stack and budget > 0:
            node, score, left = stack.pop()
            if score + left <= best_score:
                continue
            budget -= 1
            if score > best_score:
                best_score, best_node = score, node
            children = node.children
            if len(children) < len(size):
                candidates = [child for key, child in children.items() if key in size]
            else:
                candidates = [children[key] for key in size if key in children]
            scored = []
            for child in candidates:
                weight = size[child.key] / (1.0 + (clock - child.last) / RECENCY_SCALE)
                scored.append((score + weight, str(child.key), child))
            scored.sort(key=lambda item: (item[0], item[1]))  # deterministic (decide.lua breaks ties the same way)
            stack.extend((child, value, left - size[child.key]) for value, _, child in scored)
        return _path_to(best_node)

    def _extension(
        self, rest: list[Hashable], size: dict[Hashable, float], path: Sequence[Hashable], own: int
    ) -> list[Hashable]:
        """Order the blocks not matched (module docstring, steps 2 and 3). Pure."""
        postings, first, unseen = self._postings, self._first_seen, self._requests_seen + 1
        placed: list[Hashable] = []
        holders: set[int] | None = None  # earlier requests that retrieved every block placed so far
        for key in path:
            posting = set(postings.get(key, ()))
            holders = posting if holders is None else holders & posting
        if holders is not None:
            holders.discard(own)
        rest = list(rest)
        seen = max(1, self._requests_seen)
        frequency = self._frequency
        while rest and holders != set():  # no earlier request holds all placed: the rest keep the relevance order
            best: tuple[float, int, int] | None = None
            chosen = rest[0]
            for position, key in enumerate(rest):
                share = min(frequency.get(key, 0) / seen, 0.999)
                if holders is None:  # nothing placed: size * odds of retrieval
                    value = size[key] * share / (1.0 - share)
                else:  # size * P(retrieved | retrieved every block placed), smoothed toward its popularity
                    count = len(holders.intersection(postings.get(key, ())))
                    value = size[key] * (count + share) / (len(holders) + 1.0)
                rank = (-value, first.get(key, unseen), position)
                if best is None or rank < best:
                    best, chosen = rank, key
            placed.append(chosen)
            rest.remove(chosen)
            posting = set(postings.get(chosen, ()))
            posting.discard(own)
            holders = posting if holders is None else holders & posting
        return placed + rest

    # ------------------------------------------------------------------------------------------------ windows
    def plan_window(
        self,
        contexts: Sequence[Sequence[Hashable]],
        sizes: Sequence[Sequence[float]],
        capacity: float | None = None,
    ) -> tuple[list[int], list[list[Hashable]]]:
        """Order a window of waiting requests: the order they run in, and each one's block order.

        The window's requests have arrived, so they are counted in the retrieval frequencies and postings at once
        (mutates those and the block sizes the cache model weighs; the trie is left as it was). Then one of two
        regimes, by what the engine's cache holds:

        * **the window fits the cache** (``capacity`` unknown, or the window's block sizes sum to at most
          ``capacity``): what was sent before is still largely cached, so the orders follow it. The requests run in
          arrival order; each is ordered as at W=1 against the trie with the earlier ones of the window tentatively
          recorded, and its co-occurrence extension already sees the later requests of its window that hold its
          blocks, so they can reuse its prefix. (Running the request with the most cached first, LPM on the trie,
          and putting first the blocks later waiting requests hold were tried and not kept: neither gained, and
          the second lost share on LoCoMo; docs/decisions.md.)
        * **the window outgrows the cache**: two candidate plans, the online orders in arrival order (as above) and
          the batch plan (:func:`cpmemory.core.planner.plan_batch` over the window alone, block orders and a
          depth-first schedule, its requests sharing prefixes among themselves but blind to what is cached), and
          the one whose requests find more tokens cached in a model of the engine's LRU cache is kept
          (:meth:`cached_estimate`; a tie keeps the online orders, which also build the trunks later windows
          reuse). The model starts from the trie's most recently used nodes up to ``capacity`` and charges each
          prompt its own tail besides its blocks (:meth:`note_tail`, the question and template), which a window
          in arrival order evicts its own early prefixes with. Choosing between the two beats taking the batch plan
          for every such window on LoCoMo and at most window sizes on MultiHop-RAG, and matches it on synthetic,
          whose windows take the batch plan (``cpmemory_benchmarks.studies.window_sweep``; figures in
          docs/decisions.md). Without the tail the model overestimates what the cache holds and keeps the online
          orders where the batch plan wins.

        Args:
            capacity: what the engine's prefix cache holds, in the unit of ``sizes`` (None: unknown, the first
                plan).

        O(W * (match + extension)) when the window fits; else that plus ``plan_batch`` over W requests (no
        local-search ratchet: ``WINDOW_RATCHET_STEPS``), and the cache model twice (``O(W * k)`` plus the cached
        nodes, ``O(n log n)`` for ``n`` nodes that fit ``capacity``).
        """
        if len(contexts) != len(sizes):
            raise InvalidInputError("plan_window needs one size list per context")
        if capacity is not None and capacity < 0:
            raise InvalidInputError(f"capacity must be >= 0, got {capacity!r}")
        ordinals = [self.observe(keys) for keys in contexts]
        for keys, sized in zip(contexts, sizes):
            self._sizes.update(zip(keys, sized))
        if capacity is not None and window_outgrows(sizes, capacity):
            batch = _batch_plan(contexts, sizes)
            online = self._online_plan(contexts, sizes, ordinals)
            tail = self._tail or 0.0
            if self.cached_estimate(*online, capacity, tail) >= self.cached_estimate(*batch, capacity, tail):
                return online
            return batch
        return self._online_plan(contexts, sizes, ordinals)

    def _online_plan(
        self, contexts: Sequence[Sequence[Hashable]], sizes: Sequence[Sequence[float]], ordinals: Sequence[int]
    ) -> tuple[list[int], list[list[Hashable]]]:
        orders: list[list[Hashable]] = [list(keys) for keys in contexts]
        with self.tentatively() as record:
            for position, keys in enumerate(contexts):
                if not keys:
                    continue
                orders[position] = self.order(keys, sizes[position], ordinals[position])
                record(orders[position])
        return list(range(len(contexts))), orders

    def cached_estimate(self, schedule: Sequence[int], orders: Sequence[Sequence[Hashable]], capacity: float,
                        tail: float = 0.0) -> float:
        """Block tokens the window's requests would find cached, run in ``schedule`` with ``orders``, in a model of
        the engine's LRU prefix cache. Pure.

        The model starts from the trie's most recently used nodes up to ``capacity`` (what an LRU cache of that size
        still holds of the orders sent), then runs the window: each request finds the prefix of its order the model
        holds, then its path is inserted / touched and the least recently used nodes go until it fits again.
        """
        sizes = self._sizes
        fallback = (sum(sizes.values()) / len(sizes)) if sizes else 1.0
        children: dict[tuple[int, Hashable], int] = {}
        last: dict[int, tuple[float, int]] = {}  # model node -> (last use, depth)
        size_of: dict[int, float] = {}
        parent_of: dict[int, tuple[int, Hashable]] = {}
        total = 0.0
        heap: list[tuple[int, int, int, _TrieNode, int]] = []
        counter = 0
        for child in self._root.children.values():
            heap.append((-child.last, 1, counter, child, 0))
            counter += 1
        heapq.heapify(heap)
        next_id = 1
        while heap:
            negative, depth, _, node, parent = heapq.heappop(heap)
            size = sizes.get(node.key, fallback)
            if tail and node.count > sum(child.count for child in node.children.values()):
                size += tail  # a request ended here: its own tail (question, template) is cached after it
            if total + size > capacity:
                break
            total += size
            ident = next_id
            next_id += 1
            children[(parent, node.key)] = ident
            parent_of[ident] = (parent, node.key)
            last[ident] = (-negative, -depth)
            size_of[ident] = size
            for grandchild in node.children.values():
                heapq.heappush(heap, (-grandchild.last, depth + 1, counter, grandchild, ident))
                counter += 1
        lru = [(stamp, ident) for ident, stamp in last.items()]
        heapq.heapify(lru)
        clock = float(self._clock)
        found = 0.0
        for position in schedule:
            clock += 1.0
            parent, hit = 0, True
            for depth, key in enumerate(orders[position], 1):
                known = children.get((parent, key))
                if known is not None:
                    ident = known
                    if hit:
                        found += size_of[ident]
                else:
                    hit = False
                    ident = next_id
                    next_id += 1
                    children[(parent, key)] = ident
                    parent_of[ident] = (parent, key)
                    size_of[ident] = sizes.get(key, fallback)
                    total += size_of[ident]
                last[ident] = (clock, -depth)
                heapq.heappush(lru, (last[ident], ident))
                parent = ident
            if tail:
                ident = next_id
                next_id += 1
                parent_of[ident] = (parent, None)  # not in children: nothing else reaches it
                size_of[ident] = tail
                total += tail
                last[ident] = (clock, -len(orders[position]) - 1)
                heapq.heappush(lru, (last[ident], ident))
            while total > capacity and lru:
                stamp, ident = heapq.heappop(lru)
                if last.get(ident) != stamp:
                    continue
                del last[ident]
                children.pop(parent_of.pop(ident), None)
                total -= size_of.pop(ident)
        return found

    @contextlib.contextmanager
    def tentatively(self) -> Iterator[Callable[[Sequence[Hashable]], None]]:
        """Yield ``record(order)``: the order is put in the trie as if sent (the clock advances) until the block
        ends, when the trie and the clock are restored exactly (so a window can be planned and then undone)."""
        undo: list[tuple[_TrieNode, int, bool]] = []
        clock = self._clock

        def record(order: Sequence[Hashable]) -> None:
            self._clock += 1
            node = self._root
            for key in order:
                child = node.children.get(key)
                created = child is None
                if child is None:
                    child = node.children[key] = _TrieNode(key, node)
                undo.append((child, child.last, created))
                child.count += 1
                child.last = self._clock
                node = child

        try:
            yield record
        finally:
            for node, last, created in reversed(undo):
                node.count -= 1
                node.last = last
                if created:
                    del node.parent.children[node.key]  # type: ignore[union-attr]
            self._clock = clock

    # ------------------------------------------------------------------------------------------------ recording
    def record(self, order: Sequence[Hashable], request_id: Hashable) -> tuple[Hashable, ...]:
        """Record that ``order`` was sent as ``request_id`` (mutates). Returns the request ids forgotten to stay
        bounded. A request id already recorded is replaced. O(k)."""
        if request_id in self._paths:
            self.evict(request_id)
        self._clock += 1
        node = self._root
        for key in order:
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _TrieNode(key, node)
            child.count += 1
            child.last = self._clock
            node = child
        if node is self._root:
            return ()
        self._paths[request_id] = node
        forgotten: list[Hashable] = []
        while len(self._paths) > self.max_requests:
            oldest, end = self._paths.popitem(last=False)
            self._release(end)
            forgotten.append(oldest)
        return tuple(forgotten)

    @property
    def tail(self) -> float:
        """The running mean of what a prompt adds besides its blocks (:meth:`note_tail`; 0 before the first)."""
        return self._tail or 0.0

    def note_tail(self, size: float) -> None:
        """A prompt was written with ``size`` (unit of the block sizes) besides its blocks: its question and
        template, its own tail in the engine's cache (mutates a running mean, the cache model's per-request
        tail in :meth:`plan_window`). O(1)."""
        size = max(0.0, float(size))
        self._tail = size if self._tail is None else self._tail + TAIL_SMOOTHING * (size - self._tail)

    def evict(self, request_id: Hashable) -> bool:
        """The engine evicted ``request_id``'s prefix: take its weight off its path (mutates). O(k)."""
        end = self._paths.pop(request_id, None)
        if end is None:
            return False
        self._release(end)
        return True

    def _release(self, end: _TrieNode) -> None:
        node: _TrieNode | None = end
        while node is not None and node is not self._root:
            parent = node.parent
            node.count -= 1
            if node.count <= 0 and not node.children and parent is not None:
                del parent.children[node.key]
            node = parent

    def _halve_frequencies(self) -> None:
        for key in list(self._frequency):
            value = self._frequency[key] // 2
            if value:
                self._frequency[key] = value
            else:
                del self._frequency[key]
                self._first_seen.pop(key, None)
                self._postings.pop(key, None)
                self._sizes.pop(key, None)
        self._requests_seen = max(1, self._requests_seen // 2)

    # ------------------------------------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Every node's count equals the recorded requests whose paths pass through it (raises IndexIntegrityError)."""
        from cpmemory.errors import IndexIntegrityError

        expected: Counter[int] = Counter()
        for end in self._paths.values():
            node: _TrieNode | None = end
            while node is not None and node is not self._root:
                expected[id(node)] += 1
                node = node.parent
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.count != expected.get(id(node), 0) or node.count <= 0:
                raise IndexIntegrityError(f"online trie node {node.key!r}: count {node.count}, "
                                          f"{expected.get(id(node), 0)} recorded requests through it")
            stack.extend(node.children.values())


def window_outgrows(sizes: Sequence[Sequence[float]], capacity: float | None) -> bool:
    """Whether a window's block sizes sum past ``capacity`` (None: unknown, never). The rule that switches
    :meth:`OnlineOrderer.plan_window` to its batch candidate and the proxy's hold to its split. Pure."""
    return capacity is not None and sum(sum(sized) for sized in sizes) > capacity


def _batch_plan(
    contexts: Sequence[Sequence[Hashable]], sizes: Sequence[Sequence[float]]
) -> tuple[list[int], list[list[Hashable]]]:
    """``plan_batch`` over a window (token weights from ``sizes``); empty requests run last, as they came."""
    from cpmemory.core.planner import plan_batch

    filled = [position for position, keys in enumerate(contexts) if keys]
    weights = {key: size for position in filled for key, size in zip(contexts[position], sizes[position])}
    plan = plan_batch([list(contexts[position]) for position in filled], token_counts=weights,
                      ratchet_steps=WINDOW_RATCHET_STEPS)
    orders: list[list[Hashable]] = [list(keys) for keys in contexts]
    for position, order in zip(filled, plan.contexts):
        orders[position] = list(order)
    schedule = [filled[index] for index in plan.order]
    schedule += [position for position, keys in enumerate(contexts) if not keys]
    return schedule, orders


def _path_to(node: _TrieNode) -> list[Hashable]:
    path = []
    while node.parent is not None:
        path.append(node.key)
        node = node.parent
    return path[::-1]
