"""The context index: a tree over block-key lists that mirrors the engine's prefix cache (paper sections 4-5).

Every node holds an aligned ``content`` (its blocks, starting with its parent's content); a leaf stands for one or
more requests with the same set of blocks. Built offline from a batch (:meth:`ContextIndex.build`, see
:mod:`cpmemory.core._index_build`) or grown online:

* :meth:`ContextIndex.search` walks down (Algorithm 1): at each node it compares the children that share a block
  with the query beyond the node's own content (a child sharing only the node's content cannot lengthen the
  prefix), descends into the nearest, and stops when no child shares such a block or when all the node's children
  are leaves at the same distance (the longest shared prefix is found). A tie between an internal child and others
  goes to the internal child (this is what makes the paper's worked example give path [0, 0, 2]: at C5 both C4
  and C3 are at distance 1/3 + alpha from C6); a tie among some of the leaves goes to the lowest slot.
* :meth:`ContextIndex.insert` places a request where the search ends: under a matched internal node (a new child),
  beside a matched leaf (a new internal node holding their intersection), or, when the walk went into a node that
  holds blocks the request lacks, under a new node holding the longest prefix of that node the request contains.
  Identical block sets share one leaf (its frequency grows).
* :meth:`ContextIndex.evict` removes a request; a leaf left without requests goes, parents left empty are pruned
  and a parent left with one child is replaced by that child. O(height).
* With ``max_leaves`` the least recently used leaf is evicted when an insert would exceed the cap.

Not thread-safe: callers serialise access (the facade holds one index per tenant behind a lock).
"""

from __future__ import annotations

import contextlib
import gc
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from cpmemory.core._index_build import BuildOptions, NodeIds, assemble, cluster
from cpmemory.core._index_node import IndexNode, aligned, check_node, render_tree
from cpmemory.core.distance import DEFAULT_ALPHA, encode_contexts
from cpmemory.errors import IndexIntegrityError, InvalidInputError

__all__ = ["BuildOptions", "BuildReport", "ContextIndex", "InsertResult", "SearchResult"]

_TIE_TOLERANCE = 1e-12
# A search packs, per child, (shared blocks << 40) + (sum of position gaps) in one int: one dict update per hit.
# Position gaps stay far below 2**40 (a context would need ~10**6 blocks to overflow them).
_COUNT_SHIFT = 40
_COUNT_UNIT = 1 << _COUNT_SHIFT
_POSITION_MASK = _COUNT_UNIT - 1


@dataclass(frozen=True, slots=True)
class SearchResult:
    """Where a context lands in the index.

    Attributes:
        path: child slots from the root to the matched node (empty: the root, nothing shared).
        prefix: the matched node's blocks that the context holds, in the node's order: put them first.
        node_id: the matched node.
    """

    path: tuple[int, ...]
    prefix: tuple[Hashable, ...]
    node_id: int


@dataclass(frozen=True, slots=True)
class InsertResult:
    """The outcome of an insert.

    Attributes:
        path: search path of the request's leaf.
        prefix: the blocks shared with the tree that the request should start with (its leaf's parent content,
            or the whole leaf when an identical block set was already indexed).
        node_id: the node the request was placed under (or the identical leaf).
        leaf_id: the request's leaf.
        evicted: request ids dropped by the ``max_leaves`` cap to make room.
    """

    path: tuple[int, ...]
    prefix: tuple[Hashable, ...]
    node_id: int
    leaf_id: int
    evicted: tuple[Hashable, ...] = ()


@dataclass(frozen=True, slots=True)
class BuildReport:
    """How the last batch build went: sizes and which clustering ran."""

    contexts: int
    distinct_contexts: int
    exact: bool
    nodes: int


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the batch build allocates its tree (restored after).

    The build creates hundreds of thousands of linked nodes; generation scans over them cost a large share of the build
    and free nothing (every node stays referenced). The collector's previous state is restored, even on error.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _distinct(context: Iterable[Hashable]) -> list[Hashable]:
    """Validate a context; return its keys, first occurrence wins. O(len)."""
    if isinstance(context, (str, bytes)) or not isinstance(context, Iterable):
        raise InvalidInputError(f"a context must be a sequence of block keys, got {type(context).__name__}")
    try:
        return list(dict.fromkeys(context))
    except TypeError as error:
        raise InvalidInputError(f"block keys must be hashable: {error}") from error


def _prepare(context: Iterable[Hashable]) -> tuple[list[Hashable], dict[Hashable, int]]:
    """Validate a context; return its keys (first occurrence wins) and their positions."""
    keys = _distinct(context)
    return keys, dict(zip(keys, range(len(keys))))


MAX_REQUESTS_PER_LEAF = 64


class ContextIndex:
    """The context index tree (see the module docstring). Mutating methods say so; all are O(height * |C|)."""

    def __init__(self, alpha: float = DEFAULT_ALPHA, max_leaves: int | None = None) -> None:
        if not 0.0 <= alpha < 1.0:
            raise InvalidInputError(f"alpha must be in [0, 1), got {alpha}")
        if max_leaves is not None and max_leaves < 1:
            raise InvalidInputError(f"max_leaves must be positive, got {max_leaves}")
        self.alpha = alpha
        self.max_leaves = max_leaves
        # Requests with the same block set share a leaf; only the most recent ones are tracked, so a context
        # repeated forever cannot grow the request map (the older ids hold the same prefix as the newer ones).
        self.max_requests_per_leaf = MAX_REQUESTS_PER_LEAF
        self.last_build: BuildReport | None = None
        self._new_id = NodeIds()
        self._root = IndexNode(self._new_id(), (), leaf=False)
        self._nodes: dict[int, IndexNode] = {self._root.node_id: self._root}
        self._leaf_of: dict[Hashable, IndexNode] = {}
        self._recent: OrderedDict[int, IndexNode] = OrderedDict()  # leaves, least recently used first
        self._leaf_by_set: dict[frozenset[Hashable], IndexNode] = {}  # identical block sets share one leaf

    # ----------------------------------------------------------------------------------------------- batch build
    @classmethod
    def build(
        cls,
        contexts: Sequence[Sequence[Hashable]],
        request_ids: Sequence[Hashable] | None = None,
        alpha: float = DEFAULT_ALPHA,
        *,
        max_leaves: int | None = None,
        options: BuildOptions | None = None,
    ) -> ContextIndex:
        """Build an index from a batch of contexts (offline clustering; see :mod:`cpmemory.core._index_build`).

        ``request_ids`` default to ``0..N-1``. Contexts with the same set of blocks share a leaf. ``options`` tune
        the clustering (their ``alpha`` is replaced by ``alpha``). Pure with respect
        to its inputs; returns a new index.
        """
        index = cls(alpha, max_leaves)
        ids = list(range(len(contexts))) if request_ids is None else list(request_ids)
        if len(ids) != len(contexts):
            raise InvalidInputError(f"{len(contexts)} contexts but {len(ids)} request ids")
        with _collector_paused():  # the build only allocates; see _collector_paused
            prepared = [_distinct(context) for context in contexts]
            groups: dict[frozenset[Hashable], int] = {}
            leaf_keys: list[list[Hashable]] = []
            leaf_ids: list[list[Hashable]] = []
            for keys, request_id in zip(prepared, ids):
                index._check_new_request_id(request_id)
                group = groups.setdefault(frozenset(keys), len(leaf_keys))
                if group == len(leaf_keys):
                    leaf_keys.append(keys)
                    leaf_ids.append([])
                leaf_ids[group].append(request_id)
                index._leaf_of[request_id] = index._root  # reserve the id; replaced below
            exact = True
            if leaf_keys:
                encoded = encode_contexts(leaf_keys, deduplicated=True)
                forest = cluster(
                    encoded,
                    replace(options, alpha=alpha) if options else BuildOptions(alpha=alpha),
                    list(groups),
                )
                index._adopt(assemble(forest, leaf_keys, leaf_ids, index._new_id))
                exact = forest.exact
        index.last_build = BuildReport(len(contexts), len(leaf_keys), exact, len(index._nodes))
        return index

    def _adopt(self, root: IndexNode) -> None:
        self._root = root
        self._nodes = {}
        self._leaf_of = {}
        for node in root.iter_subtree():
            self._nodes[node.node_id] = node
            if node.request_ids is not None:
                self._recent[node.node_id] = node
                self._leaf_by_set[node.content_set] = node
                for request_id in node.request_ids:
                    self._leaf_of[request_id] = node
        self._enforce_cap(protect=None)

    # ------------------------------------------------------------------------------------------------- queries
    def __len__(self) -> int:
        """Number of indexed requests."""
        return len(self._leaf_of)

    @property
    def leaf_count(self) -> int:
        """Number of leaves (distinct indexed block sets)."""
        return len(self._recent)

    @property
    def node_count(self) -> int:
        """Number of nodes, the root included."""
        return len(self._nodes)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leaf_of

    def lookup(self, request_id: Hashable) -> SearchResult | None:
        """The leaf of an indexed request: its path, its full aligned content (as ``prefix``) and id. Pure."""
        leaf = self._leaf_of.get(request_id)
        return None if leaf is None else SearchResult(leaf.path(), leaf.content, leaf.node_id)

    def search(self, context: Iterable[Hashable]) -> SearchResult:
        """Find the node sharing the longest prefix with ``context`` (Algorithm 1).

        Mutates only the access counters (and the recency of a matched leaf). O(height * |context|).
        """
        keys, positions = _prepare(context)
        same = self._leaf_by_set.get(frozenset(keys))
        trail = self._descend(keys, positions) if same is None else _trail_to(same)
        for node in trail:
            node.access_count += 1
        matched = trail[-1]
        if matched.request_ids is not None:
            self._recent.move_to_end(matched.node_id)
        prefix = tuple(key for key in matched.content if key in positions)
        return SearchResult(tuple(node.slot for node in trail[1:]), prefix, matched.node_id)

    def _descend(self, keys: list[Hashable], positions: dict[Hashable, int]) -> list[IndexNode]:
        """The nodes visited from the root by the search, root first. Pure."""
        node, trail = self._root, [self._root]
        query_length = len(keys)
        base_overlap = base_positions = 0  # overlap and position term with the current node's content
        remaining = keys
        while node.children:
            # One dict update per (block, child) hit: overlap count and position sum packed in one int.
            packed: dict[int, int] = {}
            child_index = node.child_index
            if child_index is None:
                child_index = node.indexed_children()
            for key in remaining:
                entry = child_index.get(key)
                if entry:
                    here = positions[key]
                    for slot, there in entry.items():
                        packed[slot] = packed.get(slot, 0) + _COUNT_UNIT + abs(here - there)
            if not packed:
                break
            best_slot = self._nearest_child(node, packed, base_overlap, base_positions, query_length)
            if best_slot is None:
                break
            node = node.children[best_slot]
            trail.append(node)
            base_overlap += packed[best_slot] >> _COUNT_SHIFT
            base_positions += packed[best_slot] & _POSITION_MASK
            remaining = [key for key in remaining if key not in node.content_set]
        return trail

    def _nearest_child(
        self,
        node: IndexNode,
        packed: dict[int, int],
        base_overlap: int,
        base_positions: int,
        query_length: int,
    ) -> int | None:
        """The slot of the nearest candidate child, or None to stop at ``node``.

        Ties at the minimum distance go to an internal child (it stands for several requests sharing that prefix),
        then to the lowest slot. When every child of ``node`` is a leaf at the same distance, the search stops at
        ``node``: the longest prefix shared with all of them is the node's own.
        """
        children, alpha = node.children, self.alpha
        nearest: list[int] = []
        best = 2.0**62
        for slot, value in packed.items():
            total = base_overlap + (value >> _COUNT_SHIFT)
            longest = max(query_length, len(children[slot].content))
            distance = 1.0 - total / longest + alpha * (base_positions + (value & _POSITION_MASK)) / total
            if distance < best - _TIE_TOLERANCE:
                best, nearest = distance, [slot]
            elif distance <= best + _TIE_TOLERANCE:
                nearest.append(slot)
        if len(nearest) == 1:
            return nearest[0]
        internal = [slot for slot in nearest if children[slot].request_ids is None]
        if internal:
            return min(internal)
        return None if len(nearest) == len(children) else min(nearest)

    # ----------------------------------------------------------------------------------------------- mutations
    def insert(self, context: Iterable[Hashable], request_id: Hashable) -> InsertResult:
        """Index a request (mutates). Raises InvalidInputError for a request id already indexed or unhashable.

        O(height * |context|), plus O(|leaf|) when a leaf is split.
        """
        self._check_new_request_id(request_id)
        keys, positions = _prepare(context)
        key_set = frozenset(keys)
        same = self._leaf_by_set.get(key_set)
        trail = self._descend(keys, positions) if same is None else _trail_to(same)
        for node in trail:
            node.access_count += 1
        if same is not None:
            leaf, placed_under, prefix = same, same, same.content
        else:
            placed_under = self._place(trail, positions)
            leaf = IndexNode(self._new_id(), aligned(placed_under.content, keys), leaf=True)
            leaf.access_count = 1
            placed_under.add_child(leaf)
            self._nodes[leaf.node_id] = leaf
            self._leaf_by_set[key_set] = leaf
            prefix = placed_under.content
        assert leaf.request_ids is not None
        leaf.request_ids[request_id] = None
        self._leaf_of[request_id] = leaf
        self._recent[leaf.node_id] = leaf
        self._recent.move_to_end(leaf.node_id)
        evicted = self._forget_oldest_requests(leaf) + self._enforce_cap(protect=leaf)
        return InsertResult(leaf.path(), prefix, placed_under.node_id, leaf.node_id, evicted)

    def _place(self, trail: list[IndexNode], positions: dict[Hashable, int]) -> IndexNode:
        """The internal node a new leaf goes under, splitting a node on the trail when needed. Mutates."""
        keys = positions.keys()
        depth = len(trail) - 1
        while depth > 0 and not trail[depth].content_set <= keys:
            depth -= 1
        anchor = trail[depth]
        if depth == len(trail) - 1:  # the whole matched node is in the context
            if anchor.request_ids is None:
                return anchor
            return self._split(anchor.parent, anchor, anchor.content)  # type: ignore[arg-type]
        below = trail[depth + 1]
        if below.request_ids is not None:  # a leaf: the paper's new internal node holding the intersection
            shared = tuple(key for key in below.content if key in keys)
        else:  # an internal node: only its longest prefix inside the context keeps its subtree aligned
            cut = len(anchor.content)
            while cut < len(below.content) and below.content[cut] in keys:
                cut += 1
            shared = below.content[:cut]
        if len(shared) == len(anchor.content):
            return anchor
        return self._split(anchor, below, shared)

    def _split(self, parent: IndexNode, child: IndexNode, shared: tuple[Hashable, ...]) -> IndexNode:
        """Put a new internal node holding ``shared`` between ``parent`` and ``child``; returns it. Mutates."""
        slot = child.slot
        parent.remove_child(child)
        middle = IndexNode(self._new_id(), shared, leaf=False)
        middle.access_count = child.access_count
        parent.add_child(middle, slot)
        if child.content[: len(shared)] != shared:
            child.set_content(aligned(shared, child.content))
        middle.add_child(child)
        self._nodes[middle.node_id] = middle
        return middle

    def evict(self, request_id: Hashable) -> bool:
        """Remove a request (mutates). Returns False when it was not indexed. O(height + |leaf|)."""
        try:
            leaf = self._leaf_of.pop(request_id, None)
        except TypeError:
            return False
        if leaf is None:
            return False
        assert leaf.request_ids is not None
        del leaf.request_ids[request_id]
        if not leaf.request_ids:
            self._remove_leaf(leaf)
        return True

    def _remove_leaf(self, leaf: IndexNode) -> tuple[Hashable, ...]:
        """Drop a leaf with all its requests, then prune upwards. Returns the dropped request ids."""
        dropped = tuple(leaf.request_ids or ())
        for request_id in dropped:
            del self._leaf_of[request_id]
        del self._recent[leaf.node_id]
        del self._nodes[leaf.node_id]
        del self._leaf_by_set[leaf.content_set]
        parent = leaf.parent
        assert parent is not None
        parent.remove_child(leaf)
        self._prune(parent)
        return dropped

    def _prune(self, node: IndexNode) -> None:
        """Remove internal nodes left empty; replace one left with a single child by that child. O(height)."""
        while node is not self._root:
            parent = node.parent
            assert parent is not None
            if not node.children:
                parent.remove_child(node)
                del self._nodes[node.node_id]
                node = parent
                continue
            if len(node.children) == 1:
                (only,) = node.children.values()
                slot = node.slot
                parent.remove_child(node)
                node.remove_child(only)
                parent.add_child(only, slot)
                del self._nodes[node.node_id]
            return

    def _forget_oldest_requests(self, leaf: IndexNode) -> tuple[Hashable, ...]:
        """Drop the oldest request ids of ``leaf`` beyond ``max_requests_per_leaf`` (the leaf stays). Mutates."""
        assert leaf.request_ids is not None
        dropped: list[Hashable] = []
        while len(leaf.request_ids) > self.max_requests_per_leaf:
            oldest = next(iter(leaf.request_ids))
            del leaf.request_ids[oldest]
            del self._leaf_of[oldest]
            dropped.append(oldest)
        return tuple(dropped)

    def _enforce_cap(self, protect: IndexNode | None) -> tuple[Hashable, ...]:
        """Evict least recently used leaves while above ``max_leaves`` (never ``protect``)."""
        evicted: list[Hashable] = []
        while self.max_leaves is not None and len(self._recent) > self.max_leaves:
            oldest = next(iter(self._recent.values()))
            if oldest is protect:
                self._recent.move_to_end(oldest.node_id)
                continue
            evicted.extend(self._remove_leaf(oldest))
        return tuple(evicted)

    def _check_new_request_id(self, request_id: Hashable) -> None:
        try:
            known = request_id in self._leaf_of
        except TypeError as error:
            raise InvalidInputError(f"request ids must be hashable: {error}") from error
        if known:
            raise InvalidInputError(f"request id {request_id!r} is already indexed")

    # -------------------------------------------------------------------------------------------- diagnostics
    def check_integrity(self) -> None:
        """Verify every invariant; raise IndexIntegrityError on the first violation. O(total content). Pure."""
        seen_leaves: dict[int, IndexNode] = {}
        for node in self._root.iter_subtree():
            check_node(node, node is self._root)
            if self._nodes.get(node.node_id) is not node:
                raise IndexIntegrityError(f"node {node.node_id} is in the tree but not in the node map")
            if node.request_ids is not None:
                seen_leaves[node.node_id] = node
        if len(self._nodes) != sum(1 for _ in self._root.iter_subtree()):
            raise IndexIntegrityError("the node map holds nodes that are not in the tree")
        if seen_leaves.keys() != self._recent.keys():
            raise IndexIntegrityError("the recency list and the leaves of the tree differ")
        if len(self._leaf_by_set) != len(seen_leaves) or any(
            self._leaf_by_set.get(leaf.content_set) is not leaf for leaf in seen_leaves.values()
        ):
            raise IndexIntegrityError("the block-set map and the leaves of the tree differ")
        for request_id, leaf in self._leaf_of.items():
            if seen_leaves.get(leaf.node_id) is not leaf or request_id not in (leaf.request_ids or {}):
                raise IndexIntegrityError(f"request {request_id!r} maps to a leaf that does not hold it")
        if sum(leaf.frequency for leaf in seen_leaves.values()) != len(self._leaf_of):
            raise IndexIntegrityError("leaves hold request ids missing from the request map")
        if self.max_leaves is not None and len(seen_leaves) > self.max_leaves:
            raise IndexIntegrityError(f"{len(seen_leaves)} leaves exceed max_leaves={self.max_leaves}")

    def render(self, max_nodes: int = 200) -> str:
        """A readable indented rendering of the tree (first ``max_nodes`` nodes, pre-order). Pure."""
        return render_tree(self._root, len(self._nodes), max_nodes)


def _trail_to(node: IndexNode) -> list[IndexNode]:
    """The nodes from the root down to ``node``, root first. O(height)."""
    trail = [node]
    while trail[-1].parent is not None:
        trail.append(trail[-1].parent)
    return trail[::-1]
