"""Vectorised distances equal the scalar formula; the sparse linkage equals scipy's average linkage."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.cluster.hierarchy import linkage
from scipy.spatial.distance import squareform

from cpmemory.core import _index_build
from cpmemory.core.distance import condensed_distances, context_distance, encode_contexts, pair_distances

contexts_strategy = st.lists(st.lists(st.integers(0, 25), max_size=9), min_size=2, max_size=25)


def _scalar_matrix(contexts: list[list[int]], alpha: float) -> np.ndarray:
    n = len(contexts)
    return np.array(
        [
            [0.0 if i == j else context_distance(contexts[i], contexts[j], alpha) for j in range(n)]
            for i in range(n)
        ]
    )


@settings(max_examples=80, deadline=None)
@given(contexts_strategy, st.sampled_from([0.001, 0.01]))
def test_condensed_matches_the_scalar_formula(contexts: list[list[int]], alpha: float) -> None:
    encoded = encode_contexts(contexts)
    np.testing.assert_allclose(
        squareform(condensed_distances(encoded, alpha)), _scalar_matrix(contexts, alpha), atol=1e-12
    )


@settings(max_examples=80, deadline=None)
@given(contexts_strategy, st.data())
def test_pair_distances_match_the_scalar_formula(contexts: list[list[int]], data: st.DataObject) -> None:
    n = len(contexts)
    left = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=30)))
    right = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=left.size, max_size=left.size)))
    got = pair_distances(encode_contexts(contexts), left, right)
    want = [context_distance(contexts[a], contexts[b]) for a, b in zip(left, right)]
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_long_and_uneven_contexts_take_the_general_path() -> None:
    rng = np.random.default_rng(7)
    contexts = [list(rng.choice(3000, size=size, replace=False)) for size in (1000, 3, 0, 40, 999, 1)]
    encoded = encode_contexts(contexts)
    np.testing.assert_allclose(
        squareform(condensed_distances(encoded)), _scalar_matrix(contexts, 0.001), atol=1e-12
    )
    left, right = np.triu_indices(len(contexts), 1)
    want = [context_distance(contexts[a], contexts[b]) for a, b in zip(left, right)]
    np.testing.assert_allclose(pair_distances(encoded, left, right), want, atol=1e-12)


def test_duplicate_keys_keep_the_first_occurrence() -> None:
    assert context_distance([1, 1, 2], [1, 2]) == context_distance([1, 2], [1, 2]) == 0.0
    assert encode_contexts([[5, 5, 6]]).lengths.tolist() == [2]


def _merged_leaf_sets(
    children: list[list[int]], distances: list[float], n: int
) -> dict[frozenset[int], float]:
    sets = [frozenset([i]) for i in range(n)]
    out = {}
    for cluster in range(n, len(children)):
        members = frozenset().union(*(sets[c] for c in children[cluster]))
        sets.append(members)
        out[members] = round(distances[cluster], 9)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_average_linkage_equals_scipy_on_the_full_graph(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 70
    condensed = rng.random(n * (n - 1) // 2) * 0.99  # tie-free distances below 1: every pair is an edge
    left, right = np.triu_indices(n, 1)
    forest = _index_build.ClusterForest(
        [[] for _ in range(n)], [frozenset([i]) for i in range(n)], [0.0] * n, [], False
    )
    _index_build._sparse_average_linkage(forest, left, right, condensed)
    scipy_children, scipy_distances = [[] for _ in range(n)], [0.0] * n
    for a, b, d, _ in linkage(condensed, method="average"):
        scipy_children.append([int(a), int(b)])
        scipy_distances.append(d)
    assert _merged_leaf_sets(forest.children, forest.distances, n) == _merged_leaf_sets(
        scipy_children, scipy_distances, n
    )


def test_sparse_average_linkage_counts_absent_pairs_at_distance_one() -> None:
    n = 40
    rng = np.random.default_rng(5)
    square = np.ones((n, n))
    left, right = np.triu_indices(n, 1)
    keep = rng.random(left.size) < 0.2  # a sparse graph; every other pair is at distance exactly 1
    square[left[keep], right[keep]] = square[right[keep], left[keep]] = rng.random(int(keep.sum())) * 0.9
    np.fill_diagonal(square, 0.0)
    forest = _index_build.ClusterForest(
        [[] for _ in range(n)], [frozenset([i]) for i in range(n)], [0.0] * n, [], False
    )
    _index_build._sparse_average_linkage(forest, left[keep], right[keep], square[left[keep], right[keep]])
    scipy_children, scipy_distances = [[] for _ in range(n)], [0.0] * n
    for a, b, d, _ in linkage(squareform(square), method="average"):
        if d >= 1.0 - 1e-12:
            break
        scipy_children.append([int(a), int(b)])
        scipy_distances.append(d)
    assert _merged_leaf_sets(forest.children, forest.distances, n) == _merged_leaf_sets(
        scipy_children, scipy_distances, n
    )
