"""Local search over prefix trees: subtree prune-and-regraft (SPR) with a perturbation ratchet.

A prefix tree over a batch is a binary *dendrogram* whose leaves are the requests; an internal node's *core* is the
set of blocks every request below it holds, placed first by all of them, so the tokens a prefix cache reuses when
the requests run depth-first are

    value = sum over internal nodes v of tokens(core(v)).

(Any block orders define one: the lexicographic neighbours' common prefixes; any dendrogram gives block orders:
each request places its ancestors' cores top-down.) This is Camin-Sokal parsimony in disguise: a block costs one
"gain" per maximal subtree whose requests all hold it, and the value is what those shared gains save.

:func:`improve_orders` starts from the planner's best orders and applies SPR moves, as phylogenetics programs do:
cut a subtree, re-attach it on the edge where the value is highest (computed for every edge at once: the new node's
core is worth ``tokens(core(s) & core(t))`` and every ancestor of the edge loses the blocks the subtree lacks). A move
is kept only when the value rises, so the result is never worse than the start. When no move helps, the *ratchet*
(Nixon 1999) perturbs: it re-weights a random fifth of the blocks (0x or 2x), climbs on those weights, restores the
true weights, climbs again, and keeps the tree only if it beats the best so far. Seeded, so deterministic.

Sizes: a tree of R requests has 2R - 1 nodes; each SPR evaluation gathers the subtree core's columns (at most K
blocks) of the node x block core matrix, O(R K), plus O(R) for the path sums, so a pass over all subtrees is
O(R^2 K) numpy work. Requests that share no block with each other are planned apart
(connected components), which keeps R small on multi-tenant or multi-conversation batches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from cpmemory.core.planner_tree import common_prefix, remaining_blocks

Context = Sequence[Hashable]

RATCHET_FRACTION = 0.2
"""Share of the blocks whose weight a ratchet step perturbs."""
RATCHET_NODE_BUDGET = 8_000
"""Ratchet steps on a group are capped at this many tree nodes per group size (bounds time on big groups)."""
MIN_GAIN = 1e-6
"""A move must raise the value by more than this many tokens (guards against float ties cycling)."""


class Dendrogram:
    """A binary tree over ``n`` requests (nodes ``0..n-1`` are leaves) with a core per node. Mutable."""

    def __init__(self, members: np.ndarray, weights: np.ndarray) -> None:
        """Create the leaves: ``members`` is a requests x blocks 0/1 matrix, ``weights`` the tokens per block."""
        n, m = members.shape
        size = max(2 * n - 1, 1)
        self.leaves = n
        self.weights = weights.astype(np.float64)
        self.core = np.zeros((size, m), dtype=np.float32, order="F")
        self.core[:n] = members
        self.value_of = np.zeros(size)
        self.value_of[:n] = members @ self.weights
        self.parent = np.full(size, -1)
        self.left = np.full(size, -1)
        self.right = np.full(size, -1)
        self._free = list(range(size - 1, n - 1, -1))
        self.root = 0 if n else -1
        self._preorder: np.ndarray | None = None
        self._ends: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    # -- structure ------------------------------------------------------------------------------------------------

    def join(self, a: int, b: int) -> int:
        """Make a new internal node over ``a`` and ``b`` (both roots of their trees); return it."""
        node = self._free.pop()
        self.left[node], self.right[node] = a, b
        self.parent[a] = self.parent[b] = node
        self.parent[node] = -1
        self._set_core(node, self.core[a] * self.core[b])
        self._preorder = None
        return node

    def _set_core(self, node: int, core: np.ndarray) -> None:
        self.core[node] = core
        self.value_of[node] = float(core @ self.weights)

    def _internal(self) -> np.ndarray:
        nodes = np.arange(self.leaves, len(self.parent))
        return nodes[self.left[nodes] >= 0]

    def value(self) -> float:
        """Tokens reused by a depth-first run: the token weight of every internal node's core."""
        return float(self.value_of[self._internal()].sum())

    def reweigh(self, weights: np.ndarray) -> None:
        """Use other block weights (the ratchet's perturbation); cores are unchanged."""
        self.weights = weights.astype(np.float64)
        self.value_of = np.asarray(self.core @ self.weights, dtype=np.float64)

    def _replace(self, above: int, old: int, new: int) -> None:
        self.parent[new] = above
        if above < 0:
            self.root = new
        elif self.left[above] == old:
            self.left[above] = new
        else:
            self.right[above] = new

    def _refresh_up(self, node: int) -> None:
        while node >= 0:
            core = self.core[self.left[node]] * self.core[self.right[node]]
            if np.array_equal(core, self.core[node]):
                return
            self._set_core(node, core)
            node = self.parent[node]

    def prune(self, s: int) -> int:
        """Cut subtree ``s`` (not the root) out; its parent node is freed. Return the sibling that took its place."""
        p = self.parent[s]
        q = self.left[p] if self.right[p] == s else self.right[p]
        above = self.parent[p]
        self._replace(above, p, q)
        self.left[p] = self.right[p] = self.parent[p] = -1
        self.parent[s] = -1
        self._free.append(p)
        if above >= 0:
            self._refresh_up(above)
        self._preorder = None
        return q

    def regraft(self, s: int, t: int) -> None:
        """Attach subtree ``s`` on the edge above node ``t`` (under a new node)."""
        above = self.parent[t]
        self.parent[t] = -1
        node = self.join(t, s)
        self._replace(above, t, node)
        while above >= 0:
            core = self.core[above] * self.core[s]
            if np.array_equal(core, self.core[above]):
                break
            self._set_core(above, core)
            above = self.parent[above]

    def preorder(self) -> np.ndarray:
        """Nodes in depth-first preorder (left child first). Cached until the tree changes."""
        if self._preorder is None:
            self._ends = None
            order, stack = [], [self.root]
            while stack:
                node = stack.pop()
                order.append(node)
                if self.left[node] >= 0:
                    stack.append(self.right[node])
                    stack.append(self.left[node])
            self._preorder = np.array(order)
        return self._preorder

    def leaf_order(self) -> list[int]:
        """Requests in depth-first order (the schedule)."""
        return [int(node) for node in self.preorder() if node < self.leaves]

    # -- one SPR move -----------------------------------------------------------------------------------------------

    def best_move(self, s: int) -> tuple[float, int]:
        """Return ``(value gained, node t)`` for the best re-attachment of subtree ``s`` (gain <= 0: stay)."""
        order, position, end = self._layout()
        size = len(self.parent)
        p = self.parent[s]
        q = self.left[p] if self.right[p] == s else self.right[p]
        # cores of p's ancestors once s is gone (the only cores a cut changes)
        changed: dict[int, np.ndarray] = {}
        was, now, node = p, q, self.parent[p]  # the path child before and after the cut
        while node >= 0:
            sibling = self.right[node] if self.left[node] == was else self.left[node]
            core = changed.get(now, self.core[now]) * self.core[sibling]
            if np.array_equal(core, self.core[node]):
                break
            changed[node] = core
            was = now = node
            node = self.parent[node]
        cut_gain = -self.value_of[p] + sum(float(c @ self.weights) - self.value_of[n] for n, c in changed.items())
        blocks = np.flatnonzero(self.core[s])
        held = self.core[:, blocks] @ self.weights[blocks] if len(blocks) else np.zeros(size)
        own = self.value_of.copy()
        for node, core in changed.items():
            held[node] = float(core[blocks] @ self.weights[blocks]) if len(blocks) else 0.0
            own[node] = float(core @ self.weights)
        loss = own - held  # what an ancestor of the new node loses: its blocks the subtree lacks
        loss[p] = 0.0
        loss[order[position[s] : end[s]]] = 0.0
        live = order
        starts = position[live] + 1
        ends = end[live]
        diff = np.bincount(starts, loss[live], len(order) + 1) - np.bincount(ends, loss[live], len(order) + 1)
        above_loss = np.cumsum(diff)[: len(order)]  # by preorder position: sum of loss over strict ancestors
        gain = np.full(size, -np.inf)
        gain[live] = held[live] - above_loss[position[live]]
        gain[order[position[s] : end[s]]] = -np.inf
        gain[p] = -np.inf
        gain[q] = -np.inf  # where it was
        t = int(np.argmax(gain))
        if not np.isfinite(gain[t]):
            return -np.inf, -1  # nowhere else to go
        return float(gain[t] + cut_gain), t

    def _layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(preorder, preorder position per node, end of each node's subtree in positions), cached with the order."""
        order = self.preorder()
        if self._ends is None:
            position = np.full(len(self.parent), -1)
            position[order] = np.arange(len(order))
            size = np.ones(len(self.parent), dtype=np.int64)
            for node in order[::-1].tolist():
                if self.left[node] >= 0:
                    size[node] = 1 + size[self.left[node]] + size[self.right[node]]
            end = np.zeros(len(self.parent), dtype=np.int64)
            end[order] = position[order] + size[order]
            self._ends = (position, end, size)
        return order, self._ends[0], self._ends[1]

    def _ancestors(self, node: int) -> list[int]:
        out = []
        while (node := self.parent[node]) >= 0:
            out.append(node)
        return out

    def move(self, s: int, t: int) -> None:
        """Prune subtree ``s`` and regraft it above ``t``, patching the cached preorder instead of rebuilding it.

        The preorder loses ``s``'s parent and ``s``'s interval, then gets the new node before ``t`` and the interval
        after ``t``'s subtree; subtree sizes change only along the two ancestor paths. O(nodes) numpy + O(depth).
        """
        if self._preorder is None or self._ends is None:
            self.prune(s)
            self.regraft(s, t)
            return
        order = self._preorder
        position, _, size = self._ends
        p = self.parent[s]
        start, stop = position[s], position[s] + size[s]
        keep = np.ones(len(order), dtype=bool)
        keep[position[p]] = False
        keep[start:stop] = False
        moved, rest = order[start:stop], order[keep]
        size[self._ancestors(p)] -= len(moved) + 1
        self.prune(s)
        self.regraft(s, t)
        new = self.parent[s]
        at = int(np.flatnonzero(rest == t)[0])
        after = at + size[t]
        order = np.concatenate([rest[:at], [new], rest[at:after], moved, rest[after:]])
        size[new] = size[t] + len(moved) + 1
        size[self._ancestors(new)] += len(moved) + 1
        position[order] = np.arange(len(order))
        end = np.zeros(len(self.parent), dtype=np.int64)
        end[order] = position[order] + size[order]
        self._preorder = order
        self._ends = (position, end, size)

    def spr_pass(self) -> int:
        """Try to move every subtree once; apply each improving move. Return the number of moves."""
        moves = 0
        for s in [int(node) for node in self.preorder()]:
            if s == self.root or self.parent[s] < 0:
                continue
            gain, t = self.best_move(s)
            if gain > MIN_GAIN:
                self.move(s, t)
                moves += 1
        return moves

    def climb(self, max_passes: int) -> None:
        """SPR passes until none improves (or ``max_passes``)."""
        for _ in range(max_passes):
            if not self.spr_pass():
                return

    def copy(self) -> Dendrogram:
        """An independent copy (its preorder cache is rebuilt on first use)."""
        other = object.__new__(Dendrogram)
        other.__dict__ = {key: (value.copy() if isinstance(value, (np.ndarray, list)) else value)
                          for key, value in self.__dict__.items()}
        other._preorder = None
        other._ends = None
        return other


def dendrogram_from_orders(orders: Sequence[Context], members: np.ndarray, weights: np.ndarray) -> Dendrogram:
    """The dendrogram of the trie of ``orders``: sort them, join lexicographic neighbours by common prefix (stack)."""
    tree = Dendrogram(members, weights)
    ranks: dict[Hashable, int] = {}
    keyed = [tuple(ranks.setdefault(block, len(ranks)) for block in order) for order in orders]
    schedule = sorted(range(len(orders)), key=lambda index: (keyed[index], index))
    stack: list[tuple[int, int]] = []  # (node, common prefix length with the next leaf), increasing lengths
    for previous, current in zip(schedule, [*schedule[1:], None]):
        if current is None:
            shared = -1
        else:
            shared = common_prefix(keyed[previous], keyed[current])
        node = previous
        while stack and stack[-1][1] >= shared:
            left, _ = stack.pop()
            node = tree.join(left, node)
        stack.append((node, shared))
    tree.root = stack[-1][0] if stack else -1
    tree.parent[tree.root] = -1
    return tree


def build_dendrogram(
    contexts: Sequence[Context], orders: Sequence[Context], weights: Mapping[Hashable, float]
) -> tuple[Dendrogram, list[Hashable]]:
    """The dendrogram of ``orders`` over ``contexts``' blocks; returns it and the blocks (its core columns)."""
    blocks = list(dict.fromkeys(block for context in contexts for block in context))
    column = {block: i for i, block in enumerate(blocks)}
    members = np.zeros((len(contexts), len(blocks)), dtype=np.float32)
    for row, context in enumerate(contexts):
        members[row, [column[block] for block in context]] = 1.0
    block_weights = np.array([float(weights.get(block, 1.0)) for block in blocks])
    return dendrogram_from_orders(orders, members, block_weights), blocks


def orders_from_dendrogram(
    tree: Dendrogram, contexts: Sequence[Context], blocks: Sequence[Hashable], priority: Mapping[Hashable, float]
) -> list[list[Hashable]]:
    """Each request's order: its ancestors' cores top-down (new blocks by ``priority``), then its other blocks."""
    orders: list[list[Hashable]] = [[] for _ in contexts]
    stack: list[tuple[int, list[Hashable]]] = [(tree.root, [])]
    while stack:
        node, prefix = stack.pop()
        if node < tree.leaves:
            orders[node] = prefix + remaining_blocks(contexts[node], prefix)
            continue
        placed = set(prefix)
        added = [blocks[int(i)] for i in np.flatnonzero(tree.core[node]) if blocks[int(i)] not in placed]
        added.sort(key=lambda block: -priority.get(block, 0.0))
        stack.append((tree.right[node], prefix + added))
        stack.append((tree.left[node], prefix + added))
    return orders


def components(contexts: Sequence[Context]) -> list[list[int]]:
    """Groups of requests connected through shared blocks (requests of different groups share nothing)."""
    ids: dict[Hashable, int] = {}
    rows, cols = [], []
    for index, context in enumerate(contexts):
        for block in context:
            rows.append(index)
            cols.append(len(contexts) + ids.setdefault(block, len(ids)))
    size = len(contexts) + len(ids)
    graph = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(size, size))
    _, labels = connected_components(graph, directed=False)
    groups: dict[int, list[int]] = defaultdict(list)
    for index in range(len(contexts)):
        groups[int(labels[index])].append(index)
    return list(groups.values())


def improve_orders(
    contexts: Sequence[Context],
    orders: Sequence[Context],
    weights: Mapping[Hashable, float],
    priority: Mapping[Hashable, float],
    *,
    ratchet_steps: int = 8,
    max_passes: int = 6,
    seed: int = 0,
) -> tuple[list[list[Hashable]], list[int]]:
    """Improve block orders by SPR and the ratchet (see module docstring); return ``(orders, schedule)``.

    Args:
        contexts: each request's blocks in retrieval order.
        orders: a starting order per request (a permutation of its context), e.g. the planner's best.
        weights: tokens per block (default 1).
        priority: order of blocks added at one node (higher first).
        ratchet_steps: perturb-and-climb rounds per group of connected requests (0: SPR only); a group of R
            requests gets at most ``RATCHET_NODE_BUDGET // (2R - 1)`` of them.
        max_passes: SPR passes per climb.
        seed: the ratchet's random seed.

    Returns:
        New orders (each a permutation of its context) and the depth-first schedule. Their trie reuses at least as
        many tokens as the starting orders'. Deterministic for a given seed.
    """
    out = [list(order) for order in orders]
    schedule: list[int] = []
    rng = np.random.default_rng(seed)
    for group in components(contexts):
        if len(group) < 3:
            schedule.extend(group)
            continue
        tree, blocks = build_dendrogram(
            [contexts[index] for index in group], [orders[index] for index in group], weights
        )
        true_weights = tree.weights.copy()
        tree.climb(max_passes)
        best, best_value = tree.copy(), tree.value()
        for _ in range(min(ratchet_steps, RATCHET_NODE_BUDGET // (2 * len(group) - 1))):
            perturbed = rng.random(len(blocks)) < RATCHET_FRACTION
            factors = np.where(perturbed, rng.choice([0.0, 2.0], len(blocks)), 1.0)
            tree.reweigh(true_weights * factors)
            tree.climb(2)
            tree.reweigh(true_weights)
            tree.climb(max_passes)
            value = tree.value()
            if value > best_value + MIN_GAIN:
                best, best_value = tree.copy(), value
            else:
                tree = best.copy()
        planned = orders_from_dendrogram(best, [contexts[index] for index in group], blocks, priority)
        for row, index in enumerate(group):
            out[index] = planned[row]
        schedule.extend(group[row] for row in best.leaf_order())
    return out, schedule
