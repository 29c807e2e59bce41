"""Upper bounds on prefix-cache reuse, computed from the prompts' content, whatever the order, schedule or cache.

Each request's prompt is described by a :class:`RequestContent`: its *content segments* (blocks, history turns,
query; each keyed by its content and carrying its tokens) and its *frame* (everything else: system prompt, chat
template, block headers). Three bounds:

* :func:`oracle_hit_rate` (position-free): a token counts as reusable if its segment's content appeared in another
  request (every copy but the first of each content, so the figure does not depend on the order), plus every
  request's frame except one. A prefix cache cannot reach it (it reuses prefixes only).
* :func:`mst_bound_hit_rate`: a cached prefix of request j is a prefix of *one* earlier request s (the radix path it
  matches was inserted by one request), so ``cached(j) <= frame(j) + overlap(j, s) + seam(j)`` where ``overlap`` is
  the tokens of the content segments j and s share and ``seam(j)`` the longest partial match a single segment
  boundary can add (common token prefix with any other segment, e.g. a speaker name). The edges ``j -> s`` form a
  spanning forest, so total reuse is at most a maximum spanning forest of the overlap graph (built sparsely from an
  inverted index over segments; ``scipy.sparse.csgraph.minimum_spanning_tree`` on negated weights) plus the frames
  and seams of all requests but one. It holds for any order, schedule and cache size, and never exceeds the oracle.
* :func:`exact_trie_optimum` (small batches only): the most block tokens any block orders can reuse, found by a
  dynamic programme over subsets (O(3^n), n <= 16). The planner's tests and ``cpmemory_benchmarks.studies.planner_ceiling`` use it to
  measure how far the planner is from the optimum and how far the optimum is from the MST bound.
* :func:`dedup_bound_tokens` (multi-turn): tokens of blocks whose content was already shown in an earlier turn of
  the same session: what de-duplication could remove at most.

All functions are pure. Complexity: O(sum over segments of (requests holding it)^2) for the MST bound.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from itertools import pairwise

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix
from scipy.sparse.csgraph import minimum_spanning_tree

from cpmemory.bench.offline import RequestContent
from cpmemory.bench.trace import Trace
from cpmemory.core.blocks import content_hash
from cpmemory.errors import InvalidInputError

_PAIR_CHUNK = 4_000_000


def _occurrence_keys(content: RequestContent) -> list[tuple[Hashable, int]]:
    """Keys made unique within a request: the k-th copy of a content is ``(key, k)`` (multiset semantics)."""
    counts: dict[Hashable, int] = defaultdict(int)
    out = []
    for segment in content.segments:
        out.append((segment.key, counts[segment.key]))
        counts[segment.key] += 1
    return out


def _seam_slack(contents: Sequence[RequestContent]) -> np.ndarray:
    """Per request: the longest common token prefix of one of its segments with any *different* segment."""
    distinct: dict[Hashable, tuple[int, ...]] = {}
    for content in contents:
        for segment in content.segments:
            distinct.setdefault(segment.key, segment.tokens)
    keys = sorted(distinct, key=lambda key: distinct[key])
    best: dict[Hashable, int] = dict.fromkeys(keys, 0)
    for left, right in pairwise(keys):
        a, b = distinct[left], distinct[right]
        length = 0
        for x, y in zip(a, b):
            if x != y:
                break
            length += 1
        best[left] = max(best[left], length)
        best[right] = max(best[right], length)
    return np.array([max((best[s.key] for s in content.segments), default=0) for content in contents], dtype=np.int64)


def _frames_and_seams(contents: Sequence[RequestContent]) -> int:
    """Frame plus seam tokens of every request but the one with the smallest sum (the first can reuse nothing)."""
    per_request = np.array([content.frame_tokens for content in contents], dtype=np.int64) + _seam_slack(contents)
    return int(per_request.sum() - per_request.min()) if len(contents) else 0


def oracle_reusable_tokens(contents: Sequence[RequestContent]) -> int:
    """Tokens reusable with an infinite, position-free cache (see module docstring)."""
    total = 0
    seen: set[tuple[Hashable, int]] = set()
    for content in contents:
        for segment, key in zip(content.segments, _occurrence_keys(content)):
            if key in seen:
                total += len(segment.tokens)
            else:
                seen.add(key)
    return total + _frames_and_seams(contents)


def _total_prompt_tokens(contents: Sequence[RequestContent]) -> int:
    return sum(content.prompt_tokens for content in contents)


def oracle_hit_rate(contents: Sequence[RequestContent]) -> float:
    """Position-free bound on the hit rate (reusable tokens / prompt tokens)."""
    total = _total_prompt_tokens(contents)
    return min(1.0, oracle_reusable_tokens(contents) / total) if total else 0.0


def _overlap_graph(contents: Sequence[RequestContent]) -> coo_matrix:
    """Sparse upper-triangular matrix of pairwise shared content tokens (built from an inverted index)."""
    holders: dict[tuple[Hashable, int], list[int]] = defaultdict(list)
    weight: dict[tuple[Hashable, int], int] = {}
    for index, content in enumerate(contents):
        for segment, key in zip(content.segments, _occurrence_keys(content)):
            holders[key].append(index)
            weight[key] = len(segment.tokens)
    n = len(contents)
    matrix = coo_matrix((n, n), dtype=np.float64).tocsr()
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    values: list[np.ndarray] = []
    pending = 0
    for key, members in holders.items():
        if len(members) < 2 or weight[key] == 0:
            continue
        members_array = np.asarray(members, dtype=np.int32)
        upper_i, upper_j = np.triu_indices(len(members_array), k=1)
        rows.append(members_array[upper_i])
        cols.append(members_array[upper_j])
        values.append(np.full(len(upper_i), float(weight[key])))
        pending += len(upper_i)
        if pending >= _PAIR_CHUNK:
            matrix = matrix + _flush(rows, cols, values, n)
            pending = 0
    if rows:
        matrix = matrix + _flush(rows, cols, values, n)
    return matrix.tocoo()


def _flush(rows: list[np.ndarray], cols: list[np.ndarray], values: list[np.ndarray], n: int):
    chunk = coo_matrix((np.concatenate(values), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n)).tocsr()
    rows.clear()
    cols.clear()
    values.clear()
    return chunk


def mst_reusable_tokens(contents: Sequence[RequestContent]) -> int:
    """Bound on total cached tokens for any order, schedule and cache (see module docstring)."""
    if not contents:
        return 0
    graph = _overlap_graph(contents)
    forest = minimum_spanning_tree(-graph.tocsr()) if graph.nnz else None
    shared = round(-forest.sum()) if forest is not None else 0
    return shared + _frames_and_seams(contents)


def mst_bound_hit_rate(contents: Sequence[RequestContent]) -> float:
    """MST bound on the hit rate; never above :func:`oracle_hit_rate` (both are bounds; the smaller is kept)."""
    total = _total_prompt_tokens(contents)
    if not total:
        return 0.0
    return min(mst_reusable_tokens(contents), oracle_reusable_tokens(contents), total) / total


def dedup_bound_tokens(trace: Trace, count_tokens) -> int:
    """Multi-turn traces: tokens of blocks whose content an earlier turn of the same session already showed.

    Args:
        trace: the trace (0 when it is not multi-turn).
        count_tokens: ``text -> int`` token counter (the replay's tokenizer).
    """
    if not trace.multi_turn:
        return 0
    shown: dict[str, set[str]] = defaultdict(set)
    total = 0
    for request in trace.requests:
        current = shown[request.session]
        hashes = []
        for block in request.blocks:
            digest = content_hash(block.text)
            if digest in current:
                total += count_tokens(block.text)
            hashes.append(digest)
        current.update(hashes)
    return total


EXACT_MAX_REQUESTS = 16
"""Largest batch :func:`exact_trie_optimum` accepts (3^16 = 43M split evaluations)."""


def exact_trie_optimum(contexts: Sequence[Sequence[Hashable]], weights: Mapping[Hashable, float]) -> float:
    """Return the most block tokens any block orders of ``contexts`` can reuse when run depth-first (exact).

    Block orders define a prefix tree, and the reuse of a depth-first run is the token weight of the blocks every
    request below a branching node shares, summed over the nodes of a binary tree over the requests. So the best
    tree over a set S of requests is worth ``tokens(blocks all of S hold)`` plus the best split of S in two, a
    dynamic programme over the 2^n subsets (3^n split evaluations). Pure.

    Raises:
        InvalidInputError: more than :data:`EXACT_MAX_REQUESTS` requests.
    """
    n = len(contexts)
    if n > EXACT_MAX_REQUESTS:
        raise InvalidInputError(f"exact_trie_optimum takes at most {EXACT_MAX_REQUESTS} requests, got {n}")
    if n < 2:
        return 0.0
    sets = [frozenset(context) for context in contexts]
    common: dict[int, frozenset] = {}
    best = [0.0] * (1 << n)
    for mask in sorted(range(1, 1 << n), key=int.bit_count):
        low = mask & -mask
        rest = mask ^ low
        own = sets[low.bit_length() - 1]
        common[mask] = own if rest == 0 else common[rest] & own
        if rest == 0:
            continue
        split, part = -1.0, rest
        while True:
            left = part | low
            if left != mask:
                split = max(split, best[left] + best[mask ^ left])
            if part == 0:
                break
            part = (part - 1) & rest
        best[mask] = sum(float(weights.get(block, 1.0)) for block in common[mask]) + split
    return best[(1 << n) - 1]


def mst_block_reuse(contexts: Sequence[Sequence[Hashable]], weights: Mapping[Hashable, float]) -> float:
    """The MST bound on block tokens alone: a maximum spanning forest of the token-weighted pairwise overlaps."""
    index: dict[Hashable, int] = {}
    rows, cols, values = [], [], []
    for row, context in enumerate(contexts):
        for block in dict.fromkeys(context):
            rows.append(row)
            cols.append(index.setdefault(block, len(index)))
            values.append(float(weights.get(block, 1.0)))
    if not rows:
        return 0.0
    shape = (len(contexts), len(index))
    weighted = csr_matrix((values, (rows, cols)), shape=shape)
    member = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=shape)
    overlap = (weighted @ member.T).tocoo()
    keep = overlap.row < overlap.col
    if not keep.any():
        return 0.0
    top = float(overlap.data[keep].max()) + 1.0  # negate into positive costs: a minimum tree of (top - overlap)
    graph = csr_matrix((top - overlap.data[keep], (overlap.row[keep], overlap.col[keep])), shape=(len(contexts),) * 2)
    tree = minimum_spanning_tree(graph).tocoo()
    return float(np.sum(top - tree.data))
