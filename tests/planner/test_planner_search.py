"""Local search over prefix trees (cpmemory.core.planner_search), checked against an exact optimum."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.planner import plan_batch, trie_savings
from cpmemory.core.planner_search import Dendrogram, dendrogram_from_orders, improve_orders, orders_from_dendrogram
from cpmemory.core.planner_tree import first_seen_ranks

batches = st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True), min_size=3, max_size=14)


def _members(contexts, blocks):
    column = {block: i for i, block in enumerate(blocks)}
    members = np.zeros((len(contexts), len(blocks)), dtype=np.float32)
    for row, context in enumerate(contexts):
        members[row, [column[b] for b in context]] = 1.0
    return members


def exact_optimum(contexts, weights) -> float:
    """Most tokens any block orders can reuse (run depth-first): a dynamic programme over subsets of requests.

    Independent of the planner: the best binary tree over a set S is worth tokens(blocks all of S hold) plus the
    best split of S into two parts. O(3^n).
    """
    n = len(contexts)
    sets = [frozenset(c) for c in contexts]
    common: dict[int, frozenset] = {}
    best = [0.0] * (1 << n)
    for mask in sorted(range(1, 1 << n), key=lambda m: bin(m).count("1")):
        low = mask & -mask
        rest = mask ^ low
        common[mask] = sets[low.bit_length() - 1] if rest == 0 else common[rest] & sets[low.bit_length() - 1]
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
        best[mask] = sum(weights[b] for b in common[mask]) + split
    return best[(1 << n) - 1]


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
    blocks = list(dict.fromkeys(b for c in contexts for b in c))
    tree = dendrogram_from_orders(contexts, _members(contexts, blocks), np.array([weights[b] for b in blocks]))
    orders = orders_from_dendrogram(tree, contexts, blocks, {})
    ranks = first_seen_ranks(contexts)
    # siblings' subtrees may also happen to agree on the next block, so the orders can reuse a little more
    assert trie_savings(orders, weights, ranks)[0] >= tree.value()
    assert tree.value() >= trie_savings(contexts, weights, ranks)[0]  # cores are whole intersections


@settings(max_examples=80, deadline=None)
@given(batches, st.data())
def test_a_predicted_move_gain_is_the_real_change(contexts, data) -> None:
    weights = {b: data.draw(st.integers(1, 6)) for b in range(10)}
    blocks = list(dict.fromkeys(b for c in contexts for b in c))
    tree = dendrogram_from_orders(contexts, _members(contexts, blocks), np.array([weights[b] for b in blocks]))
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
        optimum = exact_optimum(contexts, weights)
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
