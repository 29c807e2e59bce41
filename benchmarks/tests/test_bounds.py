"""Reuse bounds on hand-checked cases, and bounds >= every strategy on small random traces."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.bench.offline import RequestContent, Segment
from cpmemory.bench.trace import Trace, TraceBlock, TraceRequest
from cpmemory_benchmarks.bounds import (
    dedup_bound_tokens,
    mst_bound_hit_rate,
    mst_reusable_tokens,
    oracle_hit_rate,
    oracle_reusable_tokens,
)
from cpmemory_benchmarks.replay import ReplaySettings, run_replay
from cpmemory_benchmarks.strategies import STRATEGIES


def seg(key, n, start=0):
    """A segment of n distinct tokens (tokens start at ``start`` so different keys never share a prefix)."""
    return Segment(key, tuple(range(start, start + n)))


def request(*segments, frame=0):
    return RequestContent(tuple(segments), sum(len(s.tokens) for s in segments) + frame)


def test_hand_checked_chain():
    # A{a,b} B{b,c} C{c,a}: pairwise overlaps 10 (b), 20 (c), 30 (a) -> the spanning tree keeps 30 + 20.
    a, b, c = seg("a", 30, 0), seg("b", 10, 100), seg("c", 20, 200)
    contents = [request(a, b), request(b, c), request(c, a)]
    assert mst_reusable_tokens(contents) == 50
    # position-free: every second copy is reusable: a, b, c once each = 60
    assert oracle_reusable_tokens(contents) == 60
    assert mst_bound_hit_rate(contents) == pytest.approx(50 / 120)
    assert oracle_hit_rate(contents) == pytest.approx(60 / 120)


def test_frames_count_for_all_but_one_request_and_disjoint_requests_share_only_the_frame():
    contents = [request(seg("x", 10, 0), frame=5), request(seg("y", 10, 100), frame=5),
                request(seg("z", 10, 200), frame=7)]
    assert mst_reusable_tokens(contents) == 12  # frames 5 + 7 (the smallest, 5, is the first request's)
    assert oracle_reusable_tokens(contents) == 12


def test_seam_slack_counts_a_shared_leading_run_of_different_segments():
    contents = [request(Segment("p", (1, 2, 3, 4))), request(Segment("q", (1, 2, 9, 9)))]
    assert mst_reusable_tokens(contents) == 2  # at most "1 2" can match across the seam


def test_multiset_semantics_of_repeated_content():
    twice = request(seg("a", 10), seg("a", 10))
    assert oracle_reusable_tokens([twice]) == 0  # a copy in the same prompt cannot be a cached prefix
    assert oracle_reusable_tokens([twice, twice]) == 20
    assert mst_reusable_tokens([twice, request(seg("a", 10))]) == 10  # one copy each: shared once


def test_dedup_bound_counts_earlier_turns_of_the_same_session_only():
    blocks = {name: TraceBlock(name, f"text of {name}") for name in "abc"}
    trace = Trace("t", (
        TraceRequest("s1", 1, "q", (blocks["a"], blocks["b"])),
        TraceRequest("s2", 1, "q", (blocks["a"],)),
        TraceRequest("s1", 2, "q", (blocks["a"], blocks["c"])),
        TraceRequest("s1", 3, "q", (blocks["c"], blocks["b"])),
    ), multi_turn=True)
    assert dedup_bound_tokens(trace, len) == len("text of a") + len("text of c") + len("text of b")
    assert dedup_bound_tokens(Trace("t", trace.requests, multi_turn=False), len) == 0


contents_strategy = st.lists(
    st.lists(st.sampled_from("abcdefgh"), min_size=0, max_size=5, unique=True), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(contents_strategy, st.integers(0, 20))
def test_mst_never_exceeds_oracle(groups, frame):
    sizes = {key: 5 + 7 * i for i, key in enumerate("abcdefgh")}
    contents = [request(*(seg(k, sizes[k], 1000 * i) for i, k in enumerate(group)), frame=frame) for group in groups]
    assert mst_reusable_tokens(contents) <= oracle_reusable_tokens(contents)
    assert 0.0 <= mst_bound_hit_rate(contents) <= oracle_hit_rate(contents) <= 1.0


def _random_trace(seed: int, multi_turn: bool) -> Trace:
    rng = random.Random(seed)
    corpus = [TraceBlock(f"b{i}", " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"])
                                           for _ in range(rng.randint(5, 40)))) for i in range(12)]
    requests = []
    for index in range(rng.randint(6, 14)):
        session = f"s{index % 3}" if multi_turn else f"r{index}"
        picked = rng.sample(corpus, rng.randint(1, 5))
        requests.append(TraceRequest(session, index, f"question {rng.randint(0, 3)}", tuple(picked)))
    return Trace("random", tuple(requests), multi_turn)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", ["30%", "300%"])
def test_bounds_hold_for_every_strategy_on_small_random_traces(seed, capacity):
    trace = _random_trace(seed, multi_turn=False)
    report = run_replay(trace, ReplaySettings(capacity=capacity, strategies=STRATEGIES))
    assert report.results, report.unavailable
    for name, result in report.results.items():
        assert result.hit_rate <= report.bounds.mst_bound_hit_rate + 1e-9, name
    assert report.bounds.mst_bound_hit_rate <= report.bounds.oracle_hit_rate + 1e-9


@pytest.mark.parametrize("seed", range(3))
def test_bounds_hold_for_strategies_without_dedup_on_multi_turn_traces(seed):
    trace = _random_trace(seed, multi_turn=True)
    report = run_replay(trace, ReplaySettings(capacity="40%", strategies=STRATEGIES))
    for name, result in report.results.items():
        if name != "cpmemory":  # dedup changes the prompts' content; the bounds are on the original content
            assert result.hit_rate <= report.bounds.mst_bound_hit_rate + 1e-9, name
