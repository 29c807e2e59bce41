"""Offline batch build of the context index: clustering, then the tree.

Two clusterings, chosen by the number of distinct contexts ``n``:

* ``n <= exact_limit`` (default 2,048): the paper's build. The full condensed distance matrix
  (:func:`~cpmemory.core.distance.condensed_distances`) goes to scipy ``linkage(method="average")``.
  Exact, O(n^2) memory. (scipy's average linkage alone grows too slow for the larger batches, which is why they
  take the sparse route.)
* ``n > exact_limit``: **sparse average linkage** over a candidate graph. Candidate pairs are the pairs of contexts
  that share at least one *selective* block: blocks whose document frequency is at most a cap chosen so that the
  candidate pairs fit a budget (``pair_budget_per_context * n``). Each candidate pair gets its exact distance
  (:func:`~cpmemory.core.distance.pair_distances`); each context keeps its ``neighbors`` nearest candidates.
  Average linkage then runs greedily on that graph, with every absent pair counted at distance exactly 1 (the
  distance of contexts sharing nothing): the cluster distance is ``1 + sum(d_ij - 1) / (|A| |B|)`` over the
  graph edges between A and B, updated by adding the sums of the two merged clusters. This is exact average
  linkage on the graph; the approximation is only that pairs sharing nothing but very frequent blocks, and pairs
  beyond each context's nearest ``neighbors``, count as sharing nothing. Memory O(n * neighbors).
  Clusters left apart (no edge below distance 1) are then **grouped by anchor block**: repeatedly, each remaining
  root is put with the other roots holding its most widely shared block under a new node (their intersection),
  until no block is shared by two roots. This restores the frequent-block prefixes the graph left out.

The tree is then assembled (:func:`assemble`): identical contexts share one leaf (done by the caller), each internal
node holds the intersection of its children, internal nodes with an empty content, or the same content as their
parent (an addition to the paper that keeps the tree shallow), are removed and their children relinked upwards,
children are ordered by subtree size (largest first), and contents are aligned top-down.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from cpmemory.core._index_node import IndexNode, aligned
from cpmemory.core.distance import EncodedContexts, condensed_distances, pair_distances

DEFAULT_EXACT_LIMIT = 2048
DEFAULT_NEIGHBORS = 10
DEFAULT_PAIR_BUDGET_PER_CONTEXT = 16


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """Tunables of the batch build (see the module docstring)."""

    alpha: float = 0.001
    exact_limit: int = DEFAULT_EXACT_LIMIT
    neighbors: int = DEFAULT_NEIGHBORS
    pair_budget_per_context: int = DEFAULT_PAIR_BUDGET_PER_CONTEXT


@dataclass(slots=True)
class ClusterForest:
    """Clusters over ``n`` leaves: ids ``0..n-1`` are the leaves, later ids are internal (children have lower ids).

    Attributes:
        children: children of each cluster (empty for leaves).
        contents: block ints held by each cluster (a leaf's blocks; an internal node's intersection).
        distances: the merge distance of each cluster (0 for leaves and anchor groups).
        roots: the clusters that have no parent.
        exact: True when built by exact scipy linkage.
    """

    children: list[list[int]]
    contents: list[frozenset[Hashable]]
    distances: list[float]
    roots: list[int]
    exact: bool

    def add(self, children: list[int], distance: float) -> int:
        """Create a cluster over ``children`` (content = intersection); returns its id."""
        content = self.contents[children[0]].intersection(*(self.contents[c] for c in children[1:]))
        self.children.append(children)
        self.contents.append(content)
        self.distances.append(distance)
        return len(self.children) - 1

    def add_pairs(self, pairs: list[list[int]], distances: list[float]) -> None:
        """Create one cluster per pair of existing clusters (a batch of :meth:`add`)."""
        contents = self.contents
        self.children.extend(pairs)
        contents.extend([contents[a] & contents[b] for a, b in pairs])
        self.distances.extend(distances)


def cluster(
    encoded: EncodedContexts, options: BuildOptions, leaf_sets: Sequence[frozenset[Hashable]] | None = None
) -> ClusterForest:
    """Cluster the (distinct) contexts of ``encoded``. Pure; see the module docstring for the two regimes.

    ``leaf_sets`` are the contexts' block sets (by default the block ints of ``encoded``); cluster contents are
    intersections of them.
    """
    n = encoded.size
    rows = (
        list(leaf_sets) if leaf_sets is not None else [frozenset(encoded.row(i).tolist()) for i in range(n)]
    )
    forest = ClusterForest([[] for _ in range(n)], rows, [0.0] * n, [], exact=n <= options.exact_limit)
    if n == 1:
        forest.roots = [0]
    elif forest.exact:
        _exact_linkage(encoded, forest, options.alpha)
    else:
        left, right, dist = _candidate_edges(encoded, options)
        _sparse_average_linkage(forest, left, right, dist)
    _dissolve_empty_roots(forest, n)
    _group_by_anchor(forest)
    return forest


def _dissolve_empty_roots(forest: ClusterForest, n: int) -> None:
    """Replace root clusters with an empty content by their children, recursively (they would be removed from the
    tree anyway), so that the anchor grouping sees every node that would otherwise hang under the root."""
    roots: list[int] = []
    stack = list(reversed(forest.roots))
    while stack:
        cluster_id = stack.pop()
        if cluster_id >= n and not forest.contents[cluster_id]:
            stack.extend(reversed(forest.children[cluster_id]))
        else:
            roots.append(cluster_id)
    forest.roots = roots


def _exact_linkage(encoded: EncodedContexts, forest: ClusterForest, alpha: float) -> None:
    from scipy.cluster.hierarchy import linkage

    merges = linkage(condensed_distances(encoded, alpha), method="average")
    for left, right, distance, _count in merges:
        forest.add([int(left), int(right)], float(distance))
    forest.roots = [len(forest.children) - 1]


def _selective_cap(document_frequency: np.ndarray, budget: int) -> int:
    """Largest document frequency whose blocks' pairs, all counted, stay within ``budget``."""
    frequencies = np.arange(document_frequency.max(initial=0) + 1)
    blocks_per_frequency = np.bincount(document_frequency, minlength=frequencies.size)
    pairs = np.cumsum(blocks_per_frequency * frequencies * (frequencies - 1) // 2)
    within = np.nonzero(pairs <= budget)[0]
    return int(within[-1]) if within.size else 1


def _candidate_edges(
    encoded: EncodedContexts, options: BuildOptions
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs sharing a selective block, pruned to each context's nearest ``neighbors``; with exact distances."""
    n = encoded.size
    document_frequency = np.bincount(encoded.indices, minlength=encoded.vocabulary_size)
    cap = _selective_cap(document_frequency, options.pair_budget_per_context * n)
    row_of_entry = np.repeat(np.arange(n, dtype=np.int64), encoded.lengths)
    frequency_of_entry = document_frequency[encoded.indices]
    keep = (frequency_of_entry >= 2) & (frequency_of_entry <= cap)
    order = np.lexsort((row_of_entry[keep], encoded.indices[keep]))
    owners, frequencies = row_of_entry[keep][order], frequency_of_entry[keep][order]
    lefts, rights = [], []
    for frequency in np.unique(
        frequencies
    ):  # blocks grouped by frequency: one (blocks x frequency) matrix each
        members = owners[frequencies == frequency].reshape(-1, frequency)
        first, second = np.triu_indices(int(frequency), 1)
        lefts.append(members[:, first].ravel())
        rights.append(members[:, second].ravel())
    if not lefts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    pair_keys, shared = np.unique(np.concatenate(lefts) * n + np.concatenate(rights), return_counts=True)
    left, right = pair_keys // n, pair_keys % n
    # Exact distances only for each context's pairs sharing the most selective blocks, then the nearest of those.
    left, right, _ = _nearest(
        left, right, -np.minimum(shared, 32767).astype(np.int16), n, 2 * options.neighbors
    )
    dist = pair_distances(encoded, left, right, options.alpha)
    return _nearest(left, right, dist, n, options.neighbors)


def _nearest(
    left: np.ndarray, right: np.ndarray, dist: np.ndarray, n: int, neighbors: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keep the edges that are among the ``neighbors`` nearest (lowest ``dist``) of either endpoint."""
    both_from = np.concatenate([left, right])
    both_dist = np.concatenate([dist, dist])
    edge = np.concatenate([np.arange(left.size), np.arange(left.size)])
    order = np.argsort(
        both_dist, kind="stable"
    )  # nearest first, ties by edge order (radix sort for int16) ...
    order = order[np.argsort(both_from[order], kind="stable")]  # ... within each context
    starts = np.searchsorted(both_from[order], np.arange(n))
    rank = np.arange(order.size) - starts[both_from[order]]
    selected = np.zeros(left.size, dtype=bool)
    selected[edge[order][rank < neighbors]] = True
    return left[selected], right[selected], dist[selected]


def _sparse_average_linkage(
    forest: ClusterForest, left: np.ndarray, right: np.ndarray, dist: np.ndarray
) -> None:
    """Average linkage on a sparse graph where absent pairs are at distance 1 (module docstring).

    Runs in rounds of reciprocal nearest neighbours: every pair of clusters that are each other's nearest neighbour
    is merged in the same round. Average linkage is reducible, so this gives the same dendrogram as merging the
    closest pair one at a time, while each round is a handful of vectorised passes over the edge list
    (O(E log E)) instead of a Python heap operation per edge.
    """
    n = len(forest.children)
    size = np.ones(2 * n, dtype=np.float64)
    label = np.arange(2 * n, dtype=np.int64)
    first, second, excess = left.astype(np.int64), right.astype(np.int64), dist - 1.0  # excess: sum(d_ij - 1)
    alive = np.zeros(2 * n, dtype=bool)
    alive[:n] = True
    while first.size:
        pairs, merge_distance = _reciprocal_nearest(first, second, excess, size)
        if pairs.size == 0:
            break
        merged = np.arange(len(forest.children), len(forest.children) + len(pairs))
        forest.add_pairs(pairs.tolist(), merge_distance.tolist())
        size[merged] = size[pairs[:, 0]] + size[pairs[:, 1]]
        label[pairs[:, 0]] = label[pairs[:, 1]] = merged
        alive[pairs.ravel()] = False
        alive[merged] = True
        first, second, excess = _relabel_edges(first, second, excess, label, 2 * n)
    forest.roots = np.nonzero(alive[: len(forest.children)])[0].tolist()


def _reciprocal_nearest(
    first: np.ndarray, second: np.ndarray, excess: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(a, b)`` (a < b) that are each other's nearest neighbour below distance 1, and their distances."""
    distance = 1.0 + excess / (size[first] * size[second])
    close = distance < 1.0
    source = np.concatenate([first[close], second[close]])
    target = np.concatenate([second[close], first[close]])
    both = np.concatenate([distance[close], distance[close]])
    if source.size == 0:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0)
    # Per source: nearest first, ties to the lowest target id. This orders pairs totally by (distance, ids), so the
    # globally closest pair is always reciprocal and every round merges at least one pair.
    order = np.argsort(source, kind="stable")
    source, target, both = source[order], target[order], both[order]
    starts = np.nonzero(np.concatenate([[True], source[1:] != source[:-1]]))[0]
    nearest_distance = np.minimum.reduceat(both, starts)
    segment = np.repeat(np.arange(starts.size), np.diff(np.append(starts, source.size)))
    at_minimum = both == nearest_distance[segment]  # ties go to the lowest target id: a total order on pairs,
    nearest_target = np.minimum.reduceat(np.where(at_minimum, target, np.iinfo(np.int64).max), starts)
    heads = source[starts]  # so the globally closest pair is always reciprocal and every round merges one
    nearest = np.full(size.size, -1, dtype=np.int64)
    nearest[heads] = nearest_target
    mutual = (nearest[nearest_target] == heads) & (heads < nearest_target)
    return np.stack([heads[mutual], nearest_target[mutual]], axis=1), nearest_distance[mutual]


def _relabel_edges(
    first: np.ndarray, second: np.ndarray, excess: np.ndarray, label: np.ndarray, bound: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Move edges onto the merged clusters: drop edges inside one, add up edges now joining the same two.

    Only edges touching a cluster merged this round change, and only they can coincide, so only they are sorted.
    """
    new_first, new_second = label[first], label[second]
    touched = (new_first != first) | (new_second != second)
    moved_first, moved_second = new_first[touched], new_second[touched]
    outside = moved_first != moved_second
    low = np.minimum(moved_first[outside], moved_second[outside])
    high = np.maximum(moved_first[outside], moved_second[outside])
    keys, inverse = np.unique(low * bound + high, return_inverse=True)
    summed = np.bincount(inverse, weights=excess[touched][outside], minlength=keys.size)
    kept = ~touched
    return (
        np.concatenate([first[kept], keys // bound]),
        np.concatenate([second[kept], keys % bound]),
        np.concatenate([excess[kept], summed]),
    )


_ANCHOR_SPLIT_MIN = 16  # groups larger than this are themselves grouped by the next anchor block
_ANCHOR_MAX_DEPTH = 24


def _group_by_anchor(forest: ClusterForest) -> None:
    """Group the remaining roots by their most widely shared block until no block is shared by two roots."""
    forest.roots = _anchor_level(forest, forest.roots, frozenset(), 0)


def _anchor_level(
    forest: ClusterForest, roots: list[int], base: frozenset[Hashable], depth: int
) -> list[int]:
    """One level of anchor grouping over ``roots``, whose contents all hold ``base``; returns the new roots.

    A group of more than ``_ANCHOR_SPLIT_MIN`` members is first grouped inside by the blocks beyond its own
    intersection, so no node keeps thousands of children sharing a popular block (searches stay cheap).
    """
    while len(roots) > 1:
        counts = Counter(block for root in roots for block in forest.contents[root] if block not in base)
        groups: dict[Hashable, list[int]] = {}
        loose: list[int] = []
        for root in roots:
            shared = [block for block in forest.contents[root] if counts[block] >= 2]
            if shared:  # the most widely shared block; ties by repr so the result does not depend on hashing
                anchor = max(shared, key=lambda block: (counts[block], repr(block)))
                groups.setdefault(anchor, []).append(root)
            else:
                loose.append(root)
        formed = [_anchor_group(forest, members, depth) for members in groups.values() if len(members) >= 2]
        if not formed:
            break
        loose.extend(members[0] for members in groups.values() if len(members) == 1)
        roots = formed + loose
    return roots


def _anchor_group(forest: ClusterForest, members: list[int], depth: int) -> int:
    """A new cluster over ``members``; returns its id (``depth`` is kept for the callers' bookkeeping)."""
    del depth
    return forest.add(members, 1.0)


class NodeIds:
    """A callable handing out increasing node ids (one per index)."""

    __slots__ = ("next_id",)

    def __init__(self, start: int = 0) -> None:
        self.next_id = start

    def __call__(self) -> int:
        value = self.next_id
        self.next_id += 1
        return value


def assemble(
    forest: ClusterForest,
    leaf_keys: Sequence[Sequence[Hashable]],
    leaf_request_ids: Sequence[Sequence[Hashable]],
    new_id: NodeIds,
) -> IndexNode:
    """Turn a cluster forest into an aligned tree under a virtual root; returns the root. O(total content).

    ``leaf_keys[i]`` is leaf ``i``'s context in its original order (its set is ``forest.contents[i]``) and
    ``leaf_request_ids[i]`` the requests it stands for; internal contents are ordered as in their first
    (lowest-numbered) leaf, then aligned top-down behind the parent's content.
    """
    leaves, total = len(leaf_keys), len(forest.children)
    size = [1] * total
    first_leaf = list(range(total))
    for c in range(leaves, total):
        size[c] = sum(size[child] for child in forest.children[c])
        first_leaf[c] = min(first_leaf[child] for child in forest.children[c])
    order = {"size": size, "first_leaf": first_leaf}
    root = IndexNode(new_id(), (), leaf=False)
    root.child_index = None
    stack: list[tuple[list[int], IndexNode]] = [(forest.roots, root)]
    while stack:
        clusters, parent = stack.pop()
        prefix, prefix_set = parent.content, parent.content_set
        attached = _flatten(forest, clusters, len(prefix), order, leaves)
        if len(attached) > _ANCHOR_SPLIT_MIN:  # a wide node: group its children by their next anchor block
            attached = _regroup(forest, attached, prefix_set, order, leaves)
        for child in attached:
            content = forest.contents[child]  # the aligned content's set: the parent's blocks are all in it
            if child < leaves:
                keys = aligned(prefix, leaf_keys[child], prefix_set)
                node = IndexNode(new_id(), keys, leaf=True, content_set=content)
                node.request_ids = dict.fromkeys(leaf_request_ids[child])
            else:
                rest = [
                    key for key in leaf_keys[first_leaf[child]] if key in content and key not in prefix_set
                ]
                node = IndexNode(new_id(), (*prefix, *rest), leaf=False, content_set=content)
                node.child_index = None  # deferred to the first search through this node
                node.merge_distance = forest.distances[child]
                stack.append((forest.children[child], node))
            slot = parent.next_slot  # parent.add_child(node), inlined: the parent's child index is deferred
            node.parent, node.slot = parent, slot
            parent.children[slot] = node
            parent.next_slot = slot + 1
    return root


def _regroup(
    forest: ClusterForest,
    attached: list[int],
    prefix_set: frozenset[Hashable],
    order: dict[str, list[int]],
    leaves: int,
) -> list[int]:
    """Anchor-group a wide node's children beyond its content; new clusters get their size and first leaf."""
    before = len(forest.children)
    grouped = _anchor_level(forest, attached, prefix_set, 0)
    size, first_leaf = order["size"], order["first_leaf"]
    for c in range(before, len(forest.children)):
        size.append(sum(size[child] for child in forest.children[c]))
        first_leaf.append(min(first_leaf[child] for child in forest.children[c]))
    return sorted(grouped, key=lambda c: (-size[c], first_leaf[c])) if len(grouped) > 1 else grouped


def _flatten(
    forest: ClusterForest, clusters: list[int], parent_length: int, order: dict[str, list[int]], leaves: int
) -> list[int]:
    """Children to attach, largest subtree first, skipping internal clusters no longer than the parent's content."""
    size, first_leaf = order["size"], order["first_leaf"]

    def ranked(members: list[int]) -> list[int]:  # reversed rank: the stack pops the first child first
        if len(members) == 2:
            a, b = members
            return [b, a] if (-size[a], first_leaf[a]) <= (-size[b], first_leaf[b]) else [a, b]
        return sorted(members, key=lambda c: (-size[c], first_leaf[c]), reverse=True)

    out: list[int] = []
    stack = ranked(clusters)
    while stack:
        c = stack.pop()
        if c >= leaves and len(forest.contents[c]) <= parent_length:
            stack.extend(ranked(forest.children[c]))
        else:
            out.append(c)
    return out
