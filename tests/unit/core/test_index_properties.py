"""Invariants of the context index under any sequence of operations, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.index import BuildOptions, ContextIndex
from cpmemory.core.ordering import reorder, reorder_batch
from cpmemory.errors import IndexIntegrityError, InvalidInputError

small_context = st.lists(st.integers(0, 12), max_size=7)
operation = st.one_of(
    st.tuples(st.just("insert"), small_context, st.integers(0, 30)),
    st.tuples(st.just("search"), small_context, st.just(0)),
    st.tuples(st.just("evict"), st.just([]), st.integers(0, 30)),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(small_context, max_size=12),
    st.lists(operation, max_size=40),
    st.sampled_from([None, 3, 8]),
    st.booleans(),
)
def test_any_operation_sequence_keeps_integrity(
    initial: list[list[int]],
    operations: list[tuple[str, list[int], int]],
    max_leaves: int | None,
    sparse: bool,
) -> None:
    options = BuildOptions(exact_limit=0 if sparse else 2048)
    ids = [f"b{i}" for i in range(len(initial))]
    index = ContextIndex.build(initial, request_ids=ids, max_leaves=max_leaves, options=options)
    index.check_integrity()
    live = {
        rid: context for rid, context in zip(ids, initial) if rid in index
    }  # the cap may drop some at build
    for kind, context, number in operations:
        if kind == "insert" and number not in live:
            result = index.insert(context, number)
            live[number] = context
            for dropped in result.evicted:
                live.pop(dropped)
            assert sorted(reorder(context, result.prefix)) == sorted(set(context))
            found = index.lookup(number)
            assert found is not None and found.path == result.path
            assert set(found.prefix) == set(context)  # the leaf holds exactly the request's blocks
        elif kind == "search":
            result = index.search(context)
            assert set(result.prefix) <= set(context)
        elif kind == "evict":
            assert index.evict(number) == (number in live)
            live.pop(number, None)
        index.check_integrity()
        assert set(live) == {rid for rid in live if rid in index} and len(index) == len(live)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20)), st.lists(st.integers(0, 20)))
def test_reorder_is_a_permutation_of_the_distinct_keys(context: list[int], prefix: list[int]) -> None:
    result = reorder(context, prefix)
    distinct = list(dict.fromkeys(context))
    assert sorted(result) == sorted(distinct)
    rest = [key for key in result if key not in set(prefix)]
    assert rest == [key for key in distinct if key not in set(prefix)]  # the rest keeps its relevance order


@settings(max_examples=50, deadline=None)
@given(st.lists(small_context, min_size=1, max_size=30), st.booleans())
def test_reorder_batch_permutes_every_context(contexts: list[list[int]], sparse: bool) -> None:
    batch = reorder_batch(contexts, options=BuildOptions(exact_limit=0 if sparse else 2048))
    batch.index.check_integrity()
    assert len(batch.contexts) == len(batch.search_paths) == len(contexts)
    for original, ordered in zip(contexts, batch.contexts):
        assert sorted(ordered) == sorted(set(original))
    for a, b, path_a, path_b in zip(contexts, contexts[1:], batch.search_paths, batch.search_paths[1:]):
        if set(a) == set(b):
            assert path_a == path_b  # identical block sets share a leaf


def test_identical_contexts_share_a_leaf_with_a_frequency() -> None:
    index = ContextIndex.build([[1, 2, 3], [3, 2, 1], [1, 2, 3], [7, 8]])
    assert index.leaf_count == 2 and len(index) == 4
    assert index.lookup(0) == index.lookup(1) == index.lookup(2)
    assert "leaf x3" in index.render()
    index.insert([2, 3, 1], "again")
    assert index.lookup("again") == index.lookup(0) and index.leaf_count == 2


def test_eviction_prunes_empty_parents_and_collapses_single_children() -> None:
    index = ContextIndex.build([[1, 2, 3], [1, 2, 4], [1, 5], [9]])
    nodes_before = index.node_count
    assert index.evict(0) and index.evict(1)
    index.check_integrity()
    assert index.node_count < nodes_before - 1
    assert index.evict(2) and index.evict(3)
    assert index.node_count == 1 and len(index) == 0  # only the root is left
    assert not index.evict(3) and not index.evict(["unhashable"])  # type: ignore[arg-type]
    index.check_integrity()


def test_max_leaves_evicts_the_least_recently_used() -> None:
    index = ContextIndex(max_leaves=2)
    index.insert([1, 2], "a")
    index.insert([3, 4], "b")
    index.search([1, 2])  # touches a
    result = index.insert([5, 6], "c")
    assert result.evicted == ("b",)
    assert "a" in index and "c" in index and "b" not in index
    index.check_integrity()


@pytest.mark.parametrize("bad", ["a string", b"bytes", 42, None])
def test_a_context_that_is_not_a_sequence_is_rejected(bad: object) -> None:
    index = ContextIndex.build([[1, 2], [2, 3]])
    with pytest.raises(InvalidInputError):
        index.insert(bad, "x")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        index.search(bad)  # type: ignore[arg-type]
    index.check_integrity()
    assert len(index) == 2


def test_bad_request_ids_and_keys_leave_the_index_untouched() -> None:
    index = ContextIndex.build([[1, 2], [2, 3]])
    with pytest.raises(InvalidInputError):
        index.insert([4], 0)  # already indexed
    with pytest.raises(InvalidInputError):
        index.insert([4], ["unhashable"])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        index.insert([[1], [2]], "x")  # unhashable keys
    with pytest.raises(InvalidInputError):
        ContextIndex.build([[1], [2]], request_ids=["same", "same"])
    with pytest.raises(InvalidInputError):
        ContextIndex.build([[1], [2]], request_ids=["only one"])
    index.check_integrity()
    assert len(index) == 2 and index.leaf_count == 2


def test_empty_contexts_and_duplicate_keys() -> None:
    index = ContextIndex.build([[], [1, 1, 2], []])
    index.check_integrity()
    assert index.lookup(1) is not None and index.lookup(1).prefix == (1, 2)  # type: ignore[union-attr]
    assert index.insert([], "empty").prefix == ()
    assert index.search([]).prefix == ()
    assert reorder([3, 3, 1, 3], [1]) == [1, 3]
    index.check_integrity()


def test_a_thousand_block_context() -> None:
    big = list(range(1000))
    index = ContextIndex.build([big, big[:500], big[250:750], [5000, 1]])
    index.check_integrity()
    result = index.insert(list(reversed(big)), "reversed")
    assert sorted(reorder(list(reversed(big)), result.prefix)) == big
    assert index.lookup("reversed") == index.lookup(0)  # same block set: same leaf
    index.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    index = ContextIndex.build([[1, 2, 3], [1, 2, 4], [5, 6]])
    leaf = next(node for node in index._root.iter_subtree() if node.is_leaf and 3 in node.content_set)
    leaf.content = (3, 2, 1)  # breaks the prefix alignment
    with pytest.raises(IndexIntegrityError):
        index.check_integrity()


def test_the_sparse_build_keeps_close_contexts_together() -> None:
    rng = np.random.default_rng(0)
    families = [list(rng.choice(10_000, size=12, replace=False)) for _ in range(40)]
    contexts = []
    for family in families:
        for _ in range(5):
            member = list(family)
            member[int(rng.integers(12))] = int(rng.integers(20_000, 30_000))
            contexts.append(member)
    index = ContextIndex.build(contexts, options=BuildOptions(exact_limit=0))
    assert index.last_build is not None and not index.last_build.exact
    index.check_integrity()
    for family_number in range(40):
        paths = {index.lookup(family_number * 5 + i).path[:1] for i in range(5)}  # type: ignore[union-attr]
        assert len(paths) == 1  # the five members of a family sit under one top-level node


@pytest.mark.parametrize("arguments", [{"alpha": -0.1}, {"alpha": 1.0}, {"max_leaves": 0}])
def test_bad_settings_are_rejected(arguments: dict[str, float]) -> None:
    with pytest.raises(InvalidInputError):
        ContextIndex(**arguments)  # type: ignore[arg-type]


def test_search_counts_accesses_along_the_path() -> None:
    index = ContextIndex.build([[1, 2, 3], [1, 2, 4], [7, 8]])
    before = index.render()
    index.search([1, 2, 9])
    index.search([1, 2, 9])
    after = index.render()
    assert before != after and "hits 2" in after


@settings(max_examples=60, deadline=None)
@given(st.lists(small_context, min_size=2, max_size=25), st.lists(small_context, min_size=1, max_size=5))
def test_search_descends_into_the_nearest_child_by_the_paper_distance(
    batch: list[list[int]], queries: list[list[int]]
) -> None:
    from cpmemory.core.distance import context_distance

    index = ContextIndex.build(batch)
    for query in queries:
        keys = list(dict.fromkeys(query))
        if frozenset(keys) in index._leaf_by_set:
            continue  # an indexed block set is found directly, not by the walk
        node = index._root
        for slot in index.search(query).path:
            chosen = node.children[slot]
            hits = [c for c in node.children.values() if (c.content_set - node.content_set) & set(keys)]
            assert chosen in hits
            best = min(context_distance(keys, c.content) for c in hits)
            assert context_distance(keys, chosen.content) <= best + 1e-9
            node = chosen
