"""Prefix-tree builders for the batch planner (see :mod:`cpmemory.core.planner` for the why).

A prefix tree over a batch is a forest whose leaves are the requests and whose internal nodes carry a *core*: the
set of blocks every request below shares, placed first (in the same order) by all of them. Its value, the tokens
a prefix cache reuses when the requests run depth-first, is

    savings = sum over internal nodes v of (children(v) - 1) * tokens(core(v))

because entering each child after the first reuses the whole prefix ``core(v)``. Two builders:

* :class:`CoreTree` (``build_core_tree``): lazy Kruskal over request pairs. Pairs are taken by decreasing overlap
  (each request's ``partners`` best partners, from one sparse matrix product); a pair joins the tree of one request
  to the tree of the other at the deepest node whose core the joining tree's root core contains, creating a node
  whose core is the intersection. Its gain is the new node's core weight; since cores only shrink as trees grow,
  gains only fall, so a popped pair whose recomputed gain is below the next pair's is pushed back (lazy greedy).
  Captures pairwise similarity (clusters of near-identical requests) like the paper's clustering, weighted by tokens.
* :func:`split_tree` (``build_split_orders``): top-down conditional-frequency partition: a group of requests
  sharing a prefix places next the block that saves most, ``(holders - 1) * tokens``; its holders recurse, the
  rest choose again. Captures global popularity (the root splits on the most retrieved blocks).

Both are pure and deterministic (ties break on indices and first appearance).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
from scipy.sparse import csr_matrix

Context = Sequence[Hashable]

PARTNER_ROWS_PER_CHUNK = 1024
"""Requests whose overlaps are computed in one sparse product (bounds memory on dense overlap graphs)."""


def first_seen_ranks(contexts: Sequence[Context]) -> dict[Hashable, int]:
    """Rank of each block by first appearance in the batch (a deterministic, total tie-break)."""
    ranks: dict[Hashable, int] = {}
    for context in contexts:
        for block in context:
            ranks.setdefault(block, len(ranks))
    return ranks


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the common prefix of two sequences."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def remaining_blocks(context: Context, prefix: Sequence[Hashable]) -> list[Hashable]:
    """``context`` without the blocks of ``prefix`` (one copy per placement), in input order."""
    placed = Counter(prefix)
    out = []
    for block in context:
        if placed[block] > 0:
            placed[block] -= 1
        else:
            out.append(block)
    return out


def best_partners(
    contexts: Sequence[Context],
    weights: Mapping[Hashable, float],
    ranks: Mapping[Hashable, int],
    partners: int,
) -> list[tuple[float, int, int]]:
    """Return ``(overlap, i, j)`` pairs, i < j, for each request's ``partners`` largest overlaps (token-weighted).

    Sparse products ``W @ B.T`` (W: request x block token weights, B: 0/1 membership), computed for
    :data:`PARTNER_ROWS_PER_CHUNK` requests at a time, so memory stays O(chunk x requests) even when popular blocks
    make the overlap matrix dense. Time O(nnz of the product).
    """
    rows, cols, values = [], [], []
    for index, context in enumerate(contexts):
        for block in dict.fromkeys(context):
            rows.append(index)
            cols.append(ranks[block])
            values.append(float(weights.get(block, 1.0)))
    shape = (len(contexts), len(ranks))
    weighted = csr_matrix((values, (rows, cols)), shape=shape)
    member_t = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=shape).T.tocsc()
    pairs: dict[tuple[int, int], float] = {}
    for first in range(0, len(contexts), PARTNER_ROWS_PER_CHUNK):
        overlap = (weighted[first : first + PARTNER_ROWS_PER_CHUNK] @ member_t).tocsr()
        for offset in range(overlap.shape[0]):
            i = first + offset
            start, end = overlap.indptr[offset], overlap.indptr[offset + 1]
            others, shared = overlap.indices[start:end], overlap.data[start:end]
            keep = others != i
            others, shared = others[keep], shared[keep]
            if len(others) > partners:
                top = np.lexsort((others, -shared))[:partners]
                others, shared = others[top], shared[top]
            for j, value in zip(others.tolist(), shared.tolist()):
                pairs[(min(i, j), max(i, j))] = value
    return [(value, i, j) for (i, j), value in pairs.items() if value > 0]


class CoreTree:
    """A forest over the requests with a core per node (nodes ``0..n-1`` are the requests). Mutable while built."""

    def __init__(self, contexts: Sequence[Context], weights: Mapping[Hashable, float]) -> None:
        self.weights = weights
        self.core: list[frozenset] = [frozenset(context) for context in contexts]
        self.parent: list[int | None] = [None] * len(contexts)
        self.children: list[list[int] | None] = [None] * len(contexts)
        self.requests = len(contexts)

    def weight(self, blocks: frozenset) -> float:
        """Token weight of a set of blocks."""
        return sum(self.weights.get(block, 1.0) for block in blocks)

    def root(self, node: int) -> int:
        """Root of ``node``'s tree. O(depth)."""
        while (parent := self.parent[node]) is not None:
            node = parent
        return node

    def _path(self, node: int) -> list[int]:
        path = [node]
        while (parent := self.parent[node]) is not None:
            node = parent
            path.append(node)
        return path[::-1]

    def plan_join(self, root: int, leaf: int) -> tuple[float, int, frozenset]:
        """Where tree ``root`` would join ``leaf``'s tree: ``(gain, node to pair with, new core)``. Pure."""
        core = self.core[root]
        target = leaf
        for node in self._path(leaf):
            if not self.core[node] <= core:
                target = node
                break
        shared = core & self.core[target]
        return self.weight(shared), target, shared

    def join(self, root: int, target: int, shared: frozenset) -> None:
        """Hang tree ``root`` beside ``target`` under a node of core ``shared`` (reusing a node with that core)."""
        above = self.parent[target]
        target_children = self.children[target]
        root_children = self.children[root]
        if shared == self.core[target] and target_children is not None:
            target_children.append(root)
            self.parent[root] = target
            return
        if shared == self.core[root] and root_children is not None:
            self._replace_child(above, target, root)
            root_children.append(target)
            self.parent[target] = root
            return
        node = len(self.core)
        self.core.append(shared)
        self.parent.append(None)
        self.children.append([target, root])
        self.parent[target] = self.parent[root] = node
        self._replace_child(above, target, node)

    def _replace_child(self, above: int | None, old: int, new: int) -> None:
        self.parent[new] = above
        if above is not None:
            siblings = self.children[above]
            assert siblings is not None
            siblings[siblings.index(old)] = new

    def roots(self) -> list[int]:
        """Roots of the forest, in node order."""
        return [node for node, parent in enumerate(self.parent) if parent is None]


def build_core_tree(
    contexts: Sequence[Context],
    weights: Mapping[Hashable, float],
    ranks: Mapping[Hashable, int],
    partners: int = 16,
) -> CoreTree:
    """Grow a :class:`CoreTree` by lazy Kruskal over the best partner pairs (see module docstring).

    Complexity: O(P log P) heap work for P candidate pairs (at most ``partners`` per request), each pop O(depth * K).
    The tree of a request is found through a union-find over requests (trees only ever merge), not by walking up.
    """
    tree = CoreTree(contexts, weights)
    leader = list(range(len(contexts)))  # union-find over requests: requests of one tree share a leader
    top = list(range(len(contexts)))  # top[leader] = root node of that tree

    def find(request: int) -> int:
        while leader[request] != request:
            leader[request] = leader[leader[request]]
            request = leader[request]
        return request

    heap = [(-value, i, j) for value, i, j in best_partners(contexts, weights, ranks, partners)]
    heapq.heapify(heap)
    while heap:
        _, i, j = heapq.heappop(heap)
        set_i, set_j = find(i), find(j)
        if set_i == set_j:
            continue
        root_i, root_j = top[set_i], top[set_j]
        gain_i, target_i, shared_i = tree.plan_join(root_i, j)
        gain_j, target_j, shared_j = tree.plan_join(root_j, i)
        gain, joining, target, shared = max(
            (gain_i, -root_i, target_i, shared_i),
            (gain_j, -root_j, target_j, shared_j),
            key=lambda option: option[:2],
        )
        if gain <= 0:
            continue
        if heap and gain < -heap[0][0]:
            heapq.heappush(heap, (-gain, i, j))  # the pair is worth less now: retry it in its new rank
            continue
        tree.join(-joining, target, shared)
        leader[set_j] = set_i
        top[set_i] = tree.root(target)
    return tree


def core_tree_orders(
    tree: CoreTree,
    contexts: Sequence[Context],
    ranks: Mapping[Hashable, int],
    priority: Mapping[Hashable, float],
) -> list[list[Hashable]]:
    """Each request's block order: its ancestors' cores top-down, then its own remaining blocks in input order.

    Within a node, newly placed blocks go by decreasing ``priority`` (ties: first appearance), one order for the
    whole batch, so sibling subtrees that add the same block tend to agree on its position.
    """
    orders: list[list[Hashable]] = [[] for _ in contexts]
    stack: list[tuple[int, list[Hashable]]] = [(root, []) for root in tree.roots()]
    while stack:
        node, prefix = stack.pop()
        if node < tree.requests:
            orders[node] = prefix + remaining_blocks(contexts[node], prefix)
            continue
        placed = set(prefix)
        added = sorted(tree.core[node] - placed, key=lambda block: (-priority.get(block, 0.0), ranks[block]))
        children = tree.children[node]
        assert children is not None
        stack.extend((child, prefix + added) for child in children)
    return orders


def build_split_orders(
    contexts: Sequence[Context], weights: Mapping[Hashable, float], ranks: Mapping[Hashable, int]
) -> list[list[Hashable]]:
    """Top-down conditional-frequency partition (see module docstring); returns each request's block order.

    Per group: an inverted index (block -> members holding it) and a lazy max-heap of the blocks by
    ``(holders - 1) * tokens`` (ties: more holders, earlier rank). Counts only fall as holders leave the group,
    so a popped entry whose count is stale is pushed back with its current count. O(R K log) per level of the
    partition instead of a rescan of every block and member for each block chosen; each request's blocks not yet
    placed are kept as it moves down the partition.
    """
    prefixes: list[list[Hashable]] = [[] for _ in contexts]
    remaining = [list(dict.fromkeys(context)) for context in contexts]  # distinct blocks not placed yet
    stack = [list(range(len(contexts)))]
    while stack:
        members = stack.pop()
        if len(members) < 2:
            continue  # a block must be held by two requests to be worth a split
        postings: dict[Hashable, list[int]] = {}
        for member in members:
            for block in remaining[member]:
                postings.setdefault(block, []).append(member)
        counts = {block: len(holders) for block, holders in postings.items()}
        heap = [(-(count - 1) * weights.get(block, 1.0), -count, ranks[block], block)
                for block, count in counts.items() if count >= 2]
        heapq.heapify(heap)
        active = set(members)
        while heap:
            _saving, negative_count, rank, block = heapq.heappop(heap)
            count = counts[block]
            if count != -negative_count:
                if count >= 2:
                    heapq.heappush(heap, (-(count - 1) * weights.get(block, 1.0), -count, rank, block))
                continue
            holders = [m for m in postings[block] if m in active]
            for member in holders:
                active.discard(member)
                prefixes[member].append(block)
                for other in remaining[member]:
                    counts[other] -= 1
                remaining[member].remove(block)
            stack.append(holders)
    return [prefix + remaining_blocks(context, prefix) for prefix, context in zip(prefixes, contexts)]


def _most_saving(
    counts: Counter, weights: Mapping[Hashable, float], ranks: Mapping[Hashable, int]
) -> Hashable | None:
    """The block held by >= 2 requests maximising ``(holders - 1) * tokens``; ties: more holders, earlier rank."""
    best, best_key = None, None
    for block, holders in counts.items():
        if holders < 2:
            continue
        key = ((holders - 1) * weights.get(block, 1.0), holders, -ranks[block])
        if best_key is None or key > best_key:
            best, best_key = block, key
    return best
