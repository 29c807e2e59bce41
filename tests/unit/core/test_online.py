"""The online orderer: orders are permutations, the trie mirrors what was recorded, evictions take weight off."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.online import OnlineOrderer
from cpmemory.errors import InvalidInputError


def sizes(keys):
    return [10.0] * len(keys)


def test_a_request_holding_an_earlier_order_starts_with_it():
    orderer = OnlineOrderer()
    first = orderer.order(["a", "b", "c"], [5.0, 50.0, 20.0])
    orderer.record(first, "r1")
    second = orderer.order(["x", "c", "b", "a"], [5.0, 20.0, 50.0, 5.0])
    assert second[:3] == first and second[3] == "x"


def test_the_deepest_cached_path_wins_over_the_most_travelled_child():
    orderer = OnlineOrderer()
    for i in range(3):
        orderer.record(["a", "z"], f"popular{i}")
    orderer.record(["b", "c", "d"], "deep")
    assert orderer.order(["a", "b", "c", "d"], sizes("abcd"))[:3] == ["b", "c", "d"]


def _seen_and_evicted(orderer, *requests):
    """Requests the engine served and then evicted: counted and in the postings, no longer in the trie."""
    for number, keys in enumerate(requests):
        orderer.observe(keys)
        orderer.record(list(keys), f"gone{number}")
        orderer.evict(f"gone{number}")


def test_after_the_match_the_blocks_of_similar_requests_come_before_globally_popular_ones():
    orderer = OnlineOrderer()
    _seen_and_evicted(orderer, ["a", "z"], ["a", "z"], *[["w", "q"]] * 5)
    orderer.observe(["a"])
    orderer.record(["a"], "cached")
    orderer.observe(["a", "w", "z"])
    # w is retrieved 6 times, z 3 times, but every earlier request holding a (the cached prefix) held z, none w
    assert orderer.order(["a", "w", "z"], sizes("awz")) == ["a", "z", "w"]


def test_with_few_similar_requests_the_extension_leans_on_popularity():
    orderer = OnlineOrderer()
    _seen_and_evicted(orderer, *[["p", "x"]] * 4)
    orderer.observe(["a", "b"])
    orderer.record(["a", "b"], "r1")
    orderer.observe(["a", "o", "p"])
    # after the cached a, the one earlier request holding a held neither o nor p: p, retrieved 5 times in 6
    # requests, goes before o, retrieved once (same size), although o ranks higher
    assert orderer.order(["a", "o", "p"], sizes("aop")) == ["a", "p", "o"]
    # the smoothing is by tokens: a big rare block goes before a small popular one
    assert orderer.order(["a", "o", "p"], [10.0, 100.0, 10.0]) == ["a", "o", "p"]


def test_once_no_earlier_request_holds_the_blocks_placed_the_rest_keep_the_relevance_order():
    orderer = OnlineOrderer()
    _seen_and_evicted(orderer, ["q", "x"], *[["p", "y"]] * 3, *[["o", "z"]] * 2)
    orderer.observe(["c", "o", "p", "q"])
    # q (big) first by odds; of its one earlier holder's company, p is the most popular (smoothing); nobody held
    # both q and p, so c and o stay in relevance order although o is the more popular
    assert orderer.order(["c", "o", "p", "q"], [1.0, 1.0, 1.0, 100.0]) == ["q", "p", "c", "o"]


def test_unmatched_blocks_follow_by_size_times_odds_of_retrieval():
    orderer = OnlineOrderer()
    for keys in (["a", "b"], ["a", "c"], ["a", "b"], ["d"]):
        orderer.observe(keys)
    # a: 3/4, b: 2/4, c: 1/4 (same size): a, b, c; a big rare block can go before a small common one
    assert orderer.order(["c", "b", "a"], [1.0, 1.0, 1.0]) == ["a", "b", "c"]
    assert orderer.order(["b", "c"], [1.0, 10.0]) == ["c", "b"]


def test_evicting_a_request_removes_its_path():
    orderer = OnlineOrderer()
    orderer.record(["a", "b"], "r1")
    assert orderer.evict("r1") and not orderer.evict("r1")
    orderer.check_integrity()
    assert orderer.match({"a": 1.0, "b": 1.0}) == []


def test_bounded_number_of_requests_forgets_the_oldest():
    orderer = OnlineOrderer(max_requests=2)
    orderer.record(["a"], "r1")
    orderer.record(["b"], "r2")
    assert orderer.record(["c"], "r3") == ("r1",)
    assert len(orderer) == 2 and orderer.match({"a": 1.0}) == []
    orderer.check_integrity()


def test_plan_window_shares_prefixes_inside_the_window_and_leaves_the_trie_unchanged():
    orderer = OnlineOrderer()
    orderer.record(["p", "q"], "old")
    window = [["x", "y"], ["p", "q", "r"], ["s", "t"], ["u", "r", "p"]]
    schedule, orders = orderer.plan_window(window, [sizes(keys) for keys in window])
    assert schedule == [0, 1, 2, 3]  # arrival order
    assert orders[1] == ["p", "q", "r"]  # the cached order, then r (a later request of the window holds it)
    assert orders[3][:1] == ["p"]  # matches request 1's tentatively recorded order
    assert all(Counter(order) == Counter(keys) for order, keys in zip(orders, window))
    orderer.check_integrity()
    assert len(orderer) == 1


def _two_clusters():
    """Two clusters of requests arriving interleaved: each holds its cluster's three shared blocks and one own."""
    window = []
    for number in range(8):
        window.append(["a1", "a2", "a3", f"a-own{number}"])
        window.append(["b1", "b2", "b3", f"b-own{number}"])
    return window


def _hit_rate(window, schedule, orders, capacity_tokens):
    """Run the prompts through an LRU prefix cache of ``capacity_tokens``: 10 distinct tokens per block."""
    from cpmemory.bench.simulator import PrefixCacheSimulator

    token_ids: dict[str, list[int]] = {}
    cache = PrefixCacheSimulator(capacity_tokens)
    cached = total = 0
    for position in schedule:
        tokens = [t for key in orders[position]
                  for t in token_ids.setdefault(key, list(range(10 * len(token_ids), 10 * len(token_ids) + 10)))]
        cached += cache.run(tokens)
        total += len(tokens)
    return cached / total


def test_a_window_that_outgrows_the_cache_runs_its_clusters_back_to_back():
    window = _two_clusters()
    window_sizes = [sizes(keys) for keys in window]  # 40 per request, 640 for the window
    schedule, orders = OnlineOrderer().plan_window(window, window_sizes, capacity=50.0)
    assert sorted(schedule) == list(range(16))
    clusters = ["a" if orders[position][0].startswith("a") else "b" for position in schedule]
    assert clusters == sorted(clusters) or clusters == sorted(clusters, reverse=True)  # back to back
    for position in schedule:
        assert Counter(orders[position]) == Counter(window[position])  # every block kept
        assert sorted(orders[position][:3]) == sorted(window[position][:3])  # the shared blocks first
    # arrival order (what the planner does when it does not know the cache) evicts each cluster's prefix before
    # its next request comes; the batch schedule keeps it cached
    arrival = OnlineOrderer().plan_window(window, window_sizes)
    assert arrival[0] == list(range(16))
    assert _hit_rate(window, schedule, orders, 50) > _hit_rate(window, *arrival, 50) + 0.5


def test_a_window_that_fits_the_cache_is_ordered_as_it_came():
    window = _two_clusters()
    window_sizes = [sizes(keys) for keys in window]
    unknown, fits = OnlineOrderer(), OnlineOrderer()
    for orderer in (unknown, fits):
        orderer.record(["a2", "a1"], "old")
    expected = unknown.plan_window(window, window_sizes)
    assert fits.plan_window(window, window_sizes, capacity=640.0) == expected  # exactly the window: it fits
    assert expected[0] == list(range(16)) and expected[1][0][:2] == ["a2", "a1"]  # the cached order first
    with pytest.raises(InvalidInputError):
        fits.plan_window(window, window_sizes, capacity=-1.0)


def test_the_batch_plan_of_a_window_keeps_empty_requests_and_leaves_the_trie_unchanged():
    orderer = OnlineOrderer()
    orderer.record(["p", "q"], "old")
    window = _two_clusters()
    window.insert(1, [])
    schedule, orders = orderer.plan_window(window, [sizes(keys) for keys in window], capacity=50.0)
    assert sorted(schedule) == list(range(17)) and schedule[-1] == 1 and orders[1] == []
    assert orders[0][:3] == orders[3][:3]  # two requests of cluster a share their prefix
    assert all(Counter(order) == Counter(keys) for order, keys in zip(orders, window))
    orderer.check_integrity()
    assert len(orderer) == 1


def test_an_outgrown_window_follows_the_cached_order_when_the_batch_plan_would_miss_it():
    # the cache holds q before p; the window (150 > 100) holds both in every request, retrieved p first
    window = [["p", "q", f"own{number}"] for number in range(3)]
    window_sizes = [[20.0, 20.0, 10.0] for _ in window]
    orderer = OnlineOrderer()
    orderer.plan_window([["q", "p"]], [[20.0, 20.0]])  # learns the sizes
    orderer.record(["q", "p"], "old")
    schedule, orders = orderer.plan_window(window, window_sizes, capacity=100.0)
    assert schedule == [0, 1, 2] and all(order[:2] == ["q", "p"] for order in orders)  # every one reuses the cache
    batch = OnlineOrderer().plan_window(window, window_sizes, capacity=100.0)  # nothing cached: the batch plan
    assert all(order[:2] == ["p", "q"] for order in batch[1])
    assert orderer.cached_estimate(schedule, orders, 100.0) > orderer.cached_estimate(*batch, 100.0)
    orderer.check_integrity()
    assert len(orderer) == 1


def test_the_cache_model_evicts_the_least_recently_used_and_counts_each_prompt_tail():
    orderer = OnlineOrderer()
    orderer.plan_window([["a"], ["b"]], [[20.0], [20.0]])  # learns the sizes
    schedule, orders = [0, 1, 2], [["a"], ["b"], ["a"]]
    assert orderer.cached_estimate(schedule, orders, 50.0) == 20.0  # a and b fit: the third finds a
    assert orderer.cached_estimate(schedule, orders, 30.0) == 0.0  # b evicts a
    assert orderer.cached_estimate(schedule, orders, 50.0, tail=15.0) == 0.0  # b and its tail evict a
    orderer.record(["a"], "old")
    assert orderer.cached_estimate([0], [["a", "b"]], 50.0) == 20.0  # what was sent is in the model
    assert orderer.cached_estimate([0], [["a", "b"]], 10.0) == 0.0  # not when it exceeds the cache


keys_strategy = st.lists(st.sampled_from("abcdefghij"), min_size=0, max_size=6, unique=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(keys_strategy, st.booleans()), min_size=1, max_size=30))
def test_orders_are_permutations_and_the_trie_stays_consistent(steps):
    orderer = OnlineOrderer(max_requests=8)
    for number, (keys, evict) in enumerate(steps):
        orderer.observe(keys)
        order = orderer.order(keys, [float(len(k) + number % 3) for k in keys])
        assert Counter(order) == Counter(keys)
        orderer.record(order, number)
        if evict:
            orderer.evict(number // 2)
        orderer.check_integrity()
