"""The prefix-tree builders behind the planner."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.planner import restore_unshared_tails, trie_savings
from cpmemory.core.planner_tree import (
    best_partners,
    build_core_tree,
    build_split_orders,
    core_tree_orders,
    first_seen_ranks,
)

batches = st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True), min_size=1, max_size=20)


def _tree_value(tree, weights) -> float:
    total = 0.0
    for node in range(tree.requests, len(tree.core)):
        children = tree.children[node]
        if children:
            total += (len(children) - 1) * tree.weight(tree.core[node])
    return total


@settings(max_examples=150, deadline=None)
@given(batches, st.data())
def test_core_tree_is_consistent_and_its_orders_realise_its_value(contexts, data) -> None:
    weights = {b: data.draw(st.integers(1, 5)) for b in range(10)}
    ranks = first_seen_ranks(contexts)
    tree = build_core_tree(contexts, weights, ranks)
    # every node's core is inside each child's core, and every request is reachable from exactly one root
    seen = Counter()
    stack = list(tree.roots())
    while stack:
        node = stack.pop()
        seen[node] += 1
        for child in tree.children[node] or []:
            assert tree.parent[child] == node
            assert tree.core[node] <= tree.core[child]
            stack.append(child)
    assert all(seen[i] == 1 for i in range(len(contexts)))
    popularity = Counter(b for c in contexts for b in c)
    orders = core_tree_orders(tree, contexts, ranks, popularity)
    assert [Counter(o) for o in orders] == [Counter(c) for c in contexts]
    assert trie_savings(orders, weights, ranks)[0] >= _tree_value(tree, weights)


@settings(max_examples=150, deadline=None)
@given(batches)
def test_split_orders_are_permutations(contexts) -> None:
    ranks = first_seen_ranks(contexts)
    orders = build_split_orders(contexts, {}, ranks)
    assert [Counter(o) for o in orders] == [Counter(c) for c in contexts]


def test_identical_requests_share_everything() -> None:
    contexts = [[3, 1, 2], [2, 3, 1], [1, 2, 3]]
    ranks = first_seen_ranks(contexts)
    tree = build_core_tree(contexts, {}, ranks)
    orders = core_tree_orders(tree, contexts, ranks, Counter())
    assert orders[0] == orders[1] == orders[2]


def test_best_partners_keeps_the_largest_overlaps() -> None:
    contexts = [[1, 2, 3], [1, 2, 4], [1, 5, 6], [7]]
    pairs = best_partners(contexts, {1: 1, 2: 10}, first_seen_ranks(contexts), partners=1)
    assert (11.0, 0, 1) in pairs  # 0 and 1 share 1 (weight 1) and 2 (weight 10)
    assert all(i != 3 and j != 3 for _, i, j in pairs)  # request 3 shares nothing


def test_restore_unshared_tails_keeps_only_what_neighbours_reuse() -> None:
    contexts = [[3, 2, 1], [4, 1, 2], [9, 8]]
    orders = [[1, 2, 3], [1, 2, 4], [8, 9]]
    restored = restore_unshared_tails(contexts, orders, [0, 1, 2])
    assert restored == [[1, 2, 3], [1, 2, 4], [9, 8]]  # request 2 shares nothing: input order back
