"""The offline batch planner: permutations, session order, determinism, and hits in the simulator."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.core.planner import plan_batch, trie_savings
from cpmemory.core.planner_tree import first_seen_ranks
from cpmemory.errors import InvalidInputError

contexts_strategy = st.lists(
    st.lists(st.integers(0, 12), min_size=0, max_size=6, unique=True), min_size=0, max_size=25
)


def _hits(contexts: list[list[int]], order: list[int], capacity: int, block_tokens: int = 4) -> int:
    """Cached tokens when each block is ``block_tokens`` distinct tokens, after a shared 2-token system prompt."""
    sim = PrefixCacheSimulator(capacity)
    for request, index in enumerate(order):
        tokens = [10_000, 10_001]
        for block in contexts[index]:
            tokens.extend(1000 + block * block_tokens + t for t in range(block_tokens))
        tokens.append(50_000 + request)  # a unique question
        sim.run(tokens)
    return sim.stats.cached_tokens


@settings(max_examples=150, deadline=None)
@given(contexts_strategy)
def test_plan_is_a_permutation_of_every_context_and_of_the_batch(contexts: list[list[int]]) -> None:
    plan = plan_batch(contexts)
    assert sorted(plan.order) == list(range(len(contexts)))
    assert len(plan.contexts) == len(contexts)
    for planned, original in zip(plan.contexts, contexts):
        assert Counter(planned) == Counter(original)


@settings(max_examples=100, deadline=None)
@given(contexts_strategy, st.data())
def test_sessions_keep_turn_order_and_run_back_to_back(
    contexts: list[list[int]], data: st.DataObject
) -> None:
    sessions = [data.draw(st.sampled_from("abcd")) for _ in contexts]
    plan = plan_batch(contexts, sessions=sessions)
    assert sorted(plan.order) == list(range(len(contexts)))
    for session in set(sessions):
        positions = [i for i in plan.order if sessions[i] == session]
        assert positions == sorted(positions)  # turns in order
        where = [plan.order.index(i) for i in positions]
        assert where == list(range(where[0], where[0] + len(where)))  # contiguous
    for planned, original in zip(plan.contexts, contexts):
        assert Counter(planned) == Counter(original)


def test_later_turns_keep_their_block_order() -> None:
    contexts = [[1, 2, 3], [9, 8, 7], [3, 2, 1], [5, 2]]
    plan = plan_batch(contexts, sessions=["a", "a", "b", "b"])
    assert plan.contexts[1] == [9, 8, 7]
    assert plan.contexts[3] == [5, 2]


def test_duplicate_blocks_are_kept() -> None:
    plan = plan_batch([[1, 1, 2], [2, 1]])
    assert Counter(plan.contexts[0]) == Counter([1, 1, 2])


def test_plan_is_deterministic() -> None:
    contexts = [[(i * 7 + j * 3) % 11 for j in range(5)] for i in range(40)]
    weights = {b: 1 + b % 4 for b in range(11)}
    first = plan_batch(contexts, token_counts=weights)
    second = plan_batch([list(c) for c in contexts], token_counts=dict(weights))
    assert first == second


def test_empty_batch_and_bad_input() -> None:
    assert plan_batch([]).order == []
    with pytest.raises(InvalidInputError):
        plan_batch([[1]], sessions=["a", "b"])
    with pytest.raises(InvalidInputError):
        plan_batch(["abc"])


def test_hand_made_case_beats_original_and_popularity_under_a_small_cache() -> None:
    # two families of requests: {1,2,3,x} and {4,5,6,y}, interleaved; the cache holds about one prompt
    contexts = []
    for i in range(6):
        contexts.append([20 + i, 3, 1, 2])
        contexts.append([6, 30 + i, 4, 5])
    popular = Counter(b for c in contexts for b in c)
    by_popularity = [sorted(c, key=lambda b: -popular[b]) for c in contexts]
    plan = plan_batch(contexts)
    capacity = 24
    planned = _hits(plan.contexts, plan.order, capacity)
    original = _hits(contexts, list(range(len(contexts))), capacity)
    popularity = _hits(by_popularity, list(range(len(contexts))), capacity)
    assert planned >= original and planned >= popularity
    # each request after the first of its family reuses the system prompt and its 3 shared blocks (12 tokens)
    assert planned == 2 * 5 * (2 + 12) + 2 * 1 * 2 - 2


def test_token_weights_choose_the_heavier_shared_block() -> None:
    # every request holds 1 and 2; requests 0-1 also share 3, requests 2-3 share 4. Heavy 2 must come first.
    contexts = [[1, 2, 3, 10], [3, 1, 2, 11], [2, 4, 1, 12], [4, 2, 1, 13]]
    plan = plan_batch(contexts, token_counts={1: 1, 2: 100, 3: 5, 4: 5})
    assert all(context[0] == 2 for context in plan.contexts)


def test_trie_savings_counts_common_prefixes_of_neighbours() -> None:
    orders = [[1, 2, 3], [1, 2, 4], [5], [1, 6]]
    ranks = first_seen_ranks(orders)
    saved, schedule = trie_savings(orders, {1: 10, 2: 5}, ranks)
    assert saved == 10 + 5 + 10  # [1,2,3]->[1,2,4] shares 1,2; [1,2,4]->[1,6] shares 1
    assert schedule == [0, 1, 3, 2]


@settings(max_examples=60, deadline=None)
@given(contexts_strategy)
def test_plan_never_hits_less_than_original_with_room(contexts: list[list[int]]) -> None:
    """With a cache large enough for everything, the planned trie reuses at least what the input order does."""
    plan = plan_batch(contexts)
    big = 10**6
    assert _hits(plan.contexts, plan.order, big) >= _hits(contexts, list(range(len(contexts))), big) - 0
