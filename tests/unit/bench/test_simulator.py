"""Hand-checked behaviour of the prefix-cache simulator (both modes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.errors import InvalidInputError


def test_radix_hits_longest_shared_prefix() -> None:
    sim = PrefixCacheSimulator(1000)
    assert sim.run([1, 2, 3, 4]) == 0
    assert sim.run([1, 2, 3, 9]) == 3
    assert sim.run([1, 2, 3, 9, 5]) == 4
    assert sim.run([7, 1, 2]) == 0
    stats = sim.stats
    assert (stats.requests, stats.prompt_tokens, stats.cached_tokens) == (4, 16, 7)
    assert stats.used_tokens == 4 + 1 + 1 + 3  # [1,2,3] + [4] + [9] + [5] ... + [7,1,2]
    assert stats.hit_rate == pytest.approx(7 / 16)


def test_radix_never_hits_the_last_token() -> None:
    sim = PrefixCacheSimulator(1000)
    sim.run([1, 2, 3])
    assert sim.run([1, 2, 3]) == 2
    assert sim.run([1, 2]) == 1
    assert sim.run([1]) == 0


def test_radix_page_rounding() -> None:
    sim = PrefixCacheSimulator(1000, page_size=2)
    assert sim.run([1, 2, 3, 4, 5]) == 0
    assert sim.used_tokens == 4  # the partial last page is not cached
    assert sim.run([1, 2, 3, 9]) == 2  # 3 tokens shared, rounded down to one page
    assert sim.run([1, 2, 3, 4, 7, 8]) == 4
    assert sim.run([1, 2, 3, 4]) == 2  # at most len-1 = 3 tokens, rounded down to a page


def test_radix_evicts_least_recently_used_leaf() -> None:
    sim = PrefixCacheSimulator(8)
    sim.run([1, 2, 3, 4])
    sim.run([5, 6, 7, 8])
    sim.run([1, 2, 3, 4, 0])  # touches [1,2,3,4]; 9 tokens > 8 -> evict the LRU leaf [5,6,7,8]
    assert sim.used_tokens == 5
    assert sim.stats.evicted_tokens == 4
    assert sim.run([5, 6, 7, 8]) == 0
    # [5,6,7,8] (4) joins 5 tokens -> evict LRU leaves: [0] (tick 3) first, then [1,2,3,4] became a leaf
    assert sim.used_tokens <= 8
    assert sim.run([5, 6, 7, 8, 1]) == 4


def test_radix_evicts_parent_after_its_children() -> None:
    sim = PrefixCacheSimulator(6)
    sim.run([1, 2, 3])
    sim.run([1, 2, 4])  # tree: [1,2] -> {[3], [4]}: 4 tokens
    sim.run([9, 9, 9])  # 7 tokens -> evict LRU leaf [3]
    assert sim.used_tokens == 6
    assert sim.run([1, 2, 4, 5]) == 3
    assert sim.run([1, 2, 3]) == 2  # [3] was evicted, [1,2] was not


def test_radix_capacity_zero_caches_nothing() -> None:
    sim = PrefixCacheSimulator(0)
    sim.run([1, 2, 3])
    assert sim.run([1, 2, 3]) == 0
    assert sim.used_tokens == 0


def test_vllm_block_hits_and_cap() -> None:
    sim = PrefixCacheSimulator(64, mode="vllm", page_size=4)
    assert sim.run(list(range(10))) == 0
    assert sim.used_tokens == 8  # two full blocks; the partial block is not cached
    assert sim.run(list(range(10))) == 8
    assert sim.run(list(range(8))) == 4  # hit capped at 7 tokens -> one block
    assert sim.run([0, 1, 2, 3, 9, 9, 9, 9, 4, 5, 6, 7]) == 4  # block 3 differs in content and in parent hash


def test_vllm_chained_hash_needs_the_same_prefix() -> None:
    sim = PrefixCacheSimulator(64, mode="vllm", page_size=2)
    sim.run([1, 2, 3, 4, 5])
    assert sim.run([9, 9, 3, 4, 5]) == 0  # block [3,4] is cached but under another parent


def test_vllm_evicts_least_recently_freed_tail_first() -> None:
    sim = PrefixCacheSimulator(8, mode="vllm", page_size=2)  # 4 blocks
    sim.run([1, 1, 2, 2, 0])  # blocks A=[1,1], B=[2,2]; freed B then A (tail first)
    sim.run([3, 3, 4, 4, 0])  # blocks C, D; pool full (A, B, C, D), free order B, A, D, C
    sim.run([5, 5, 0])  # needs one block: evicts B (the tail of the oldest request)
    assert sim.stats.evicted_tokens == 2
    assert sim.run([1, 1, 2, 2, 0]) == 2  # A still cached, B gone
    assert sim.run([3, 3, 4, 4, 0]) == 4 or sim.stats.evicted_tokens > 2


def test_default_vllm_block_size_is_16() -> None:
    sim = PrefixCacheSimulator(1000, mode="vllm")
    sim.run(list(range(40)))
    assert sim.used_tokens == 32
    assert sim.run(list(range(40))) == 32


def test_reset_empties_cache_and_counters() -> None:
    sim = PrefixCacheSimulator(100)
    sim.run([1, 2, 3])
    sim.reset()
    assert sim.run([1, 2, 3]) == 0
    assert sim.stats.requests == 1


@pytest.mark.parametrize("kwargs", [{"mode": "lru"}, {"page_size": 0}])
def test_bad_arguments_raise(kwargs: dict) -> None:
    with pytest.raises(InvalidInputError):
        PrefixCacheSimulator(10, **kwargs)


def test_negative_capacity_raises() -> None:
    with pytest.raises(InvalidInputError):
        PrefixCacheSimulator(-1)


def _reference_hit(cached: list[tuple[int, ...]], tokens: tuple[int, ...], page: int) -> int:
    best = 0
    for seq in cached:
        n = 0
        while n < min(len(seq), len(tokens)) and seq[n] == tokens[n]:
            n += 1
        best = max(best, n)
    limit = len(tokens) - 1
    best = min(best, limit)
    return max(best - best % page, 0)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=25),
    st.sampled_from([1, 2, 3]),
)
def test_radix_with_room_matches_brute_force(requests: list[list[int]], page: int) -> None:
    """With unlimited capacity the hit equals the longest common prefix with any earlier (page-aligned) request."""
    sim = PrefixCacheSimulator(10**9, page_size=page)
    seen: list[tuple[int, ...]] = []
    for request in requests:
        assert sim.run(request) == _reference_hit(seen, tuple(request), page)
        seen.append(tuple(request[: len(request) - len(request) % page]))
    pages = {seq[:i] for seq in seen for i in range(page, len(seq) + 1, page)}
    assert sim.used_tokens == page * len(pages)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=25),
    st.integers(0, 30),
    st.sampled_from(["radix", "vllm"]),
)
def test_capacity_is_respected_and_hits_are_bounded(
    requests: list[list[int]], capacity: int, mode: str
) -> None:
    sim = PrefixCacheSimulator(capacity, mode=mode, page_size=2)  # type: ignore[arg-type]
    for request in requests:
        hit = sim.run(np.array(request))
        assert 0 <= hit < len(request) or hit == 0
        assert hit % 2 == 0
        assert sim.used_tokens <= capacity
