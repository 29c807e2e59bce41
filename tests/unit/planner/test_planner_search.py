"""Local search over prefix trees (cpmemory.core.planner_search), checked against an exact optimum."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.planner import plan_batch, trie_savings
from cpmemory.core.planner_search import (
    Dendrogram,
    build_dendrogram,
    improve_orders,
    orders_from_dendrogram,
)
from cpmemory.core.planner_tree import first_seen_ranks
from cpmemory_benchmarks.bounds import exact_trie_optimum, mst_block_reuse

batches = st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True), min_size=3, max_size=14)


@settings(max_examples=120, deadline=None)
@given(batches, st.data())
def test_search_keeps_permutations_and_never_loses_reuse(contexts, data) -> None:
    weights = {b: data.draw(st.integers(1, 6)) for b in range(10)}
    ranks = first_seen_ranks(contexts)
    start = [list(reversed(c)) for c in contexts]
    orders, schedule = improve_orders(contexts, start, weights, {}, ratchet_steps=2)
    assert [Counter(o) for o in orders] == [Counter(c) for c in contexts]
    assert sorted(schedule) == list(range(len(contexts)))
    assert trie_savings(orders, weights, ranks)[0] >= trie_savings(start, weights, ranks)[0]


@settings(max_examples=120, deadline=None)
@given(batches, st.data())
def test_orders_of_a_dendrogram_reuse_at_least_its_value(contexts, data) -> None:
    weights = {b: data.draw(st.integers(1, 6)) for b in range(10)}
    tree, blocks = build_dendrogram(contexts, contexts, weights)
    orders = orders_from_dendrogram(tree, contexts, blocks, {})
    ranks = first_seen_ranks(contexts)
    # siblings' subtrees may also happen to agree on the next block, so the orders can reuse a little more
    assert trie_savings(orders, weights, ranks)[0] >= tree.value()
    assert tree.value() >= trie_savings(contexts, weights, ranks)[0]  # cores are whole intersections


@settings(max_examples=80, deadline=None)
@given(batches, st.data())
def test_a_predicted_move_gain_is_the_real_change(contexts, data) -> None:
    weights = {b: data.draw(st.integers(1, 6)) for b in range(10)}
    tree, _ = build_dendrogram(contexts, contexts, weights)
    for s in data.draw(st.permutations([int(n) for n in tree.preorder()]))[:6]:
        if s == tree.root:
            continue
        before = tree.value()
        gain, t = tree.best_move(s)
        if not np.isfinite(gain):
            continue
        tree.prune(s)
        tree.regraft(s, t)
        assert abs(tree.value() - (before + gain)) < 1e-6


def _clustered_batch(rng: random.Random, requests: int) -> list[list[int]]:
    """Requests drawn around a few overlapping topics, like retrieval results for related questions."""
    topics = [rng.sample(range(24), 8) for _ in range(3)]
    out = []
    for _ in range(requests):
        topic = rng.choice(topics)
        picked = rng.sample(topic, 5) + rng.sample(range(24), 1)
        out.append(list(dict.fromkeys(picked)))
    return out


def test_planner_reaches_the_exact_optimum_on_small_batches() -> None:
    rng = random.Random(7)
    planned_total = optimum_total = 0.0
    for _ in range(25):
        contexts = _clustered_batch(rng, 9)
        weights = {b: rng.randint(10, 60) for b in range(24)}
        plan = plan_batch(contexts, token_counts=weights)
        ranks = first_seen_ranks(contexts)
        planned = trie_savings([plan.contexts[i] for i in range(len(contexts))], weights, ranks)[0]
        optimum = exact_trie_optimum(contexts, weights)
        assert planned <= optimum + 1e-9  # nothing can beat the optimum: guards the savings arithmetic
        planned_total += planned
        optimum_total += optimum
    assert planned_total >= 0.99 * optimum_total, (planned_total, optimum_total)


def test_search_is_deterministic() -> None:
    rng = random.Random(3)
    contexts = _clustered_batch(rng, 40)
    weights = {b: rng.randint(10, 60) for b in range(24)}
    first = plan_batch(contexts, token_counts=weights)
    second = plan_batch([list(c) for c in contexts], token_counts=dict(weights))
    assert first == second


def test_leaves_only_tree_is_worth_nothing() -> None:
    tree = Dendrogram(np.eye(3, dtype=np.float32), np.ones(3))
    assert tree.value() == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True), min_size=2, max_size=4), st.data())
def test_exact_optimum_matches_brute_force_over_every_block_order(contexts, data) -> None:
    from itertools import permutations, product

    weights = {b: data.draw(st.integers(1, 6)) for b in range(5)}
    ranks = first_seen_ranks(contexts)
    brute = max(
        trie_savings([list(o) for o in orders], weights, ranks)[0]
        for orders in product(*(permutations(c) for c in contexts))
    )
    assert exact_trie_optimum(contexts, weights) == brute
    assert exact_trie_optimum(contexts, weights) <= mst_block_reuse(contexts, weights) + 1e-9


@settings(max_examples=80, deadline=None)
@given(batches, st.data())
def test_patched_layout_after_moves_equals_a_fresh_one(contexts, data) -> None:
    weights = dict.fromkeys(range(10), 1)
    tree, _ = build_dendrogram(contexts, contexts, weights)
    for _ in range(5):
        nodes = [int(n) for n in tree._layout()[0] if n != tree.root]
        s = data.draw(st.sampled_from(nodes))
        gain, t = tree.best_move(s)
        if not np.isfinite(gain):
            continue
        tree.move(s, t)
        order, position, end = tree._layout()
        tree._preorder = None
        fresh, fresh_position, fresh_end = tree._layout()
        assert order.tolist() == fresh.tolist()
        assert position[order].tolist() == fresh_position[fresh].tolist()
        assert end[order].tolist() == fresh_end[fresh].tolist()


def test_a_copy_is_independent_of_later_moves() -> None:
    rng = random.Random(5)
    contexts = _clustered_batch(rng, 30)
    tree, _ = build_dendrogram(contexts, contexts, {})
    tree._layout()
    snapshot = tree.copy()
    value, order = snapshot.value(), snapshot.preorder().tolist()
    tree.climb(4)
    assert snapshot.value() == value and snapshot.preorder().tolist() == order
    snapshot.climb(4)  # its own cached layout stays consistent
    assert snapshot.value() >= value
