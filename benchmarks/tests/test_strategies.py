"""Strategy helpers: turn-order repair, popularity order, the LPM scheduler, the contextpilot wrapper."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.errors import InvalidInputError
from cpmemory_benchmarks.baseline_contextpilot import contextpilot_available, plan_with_contextpilot
from cpmemory_benchmarks.strategies import LongestPrefixScheduler, PlanInput, keep_turn_order, plan_popularity


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=20), st.randoms(use_true_random=False))
def test_keep_turn_order_keeps_pattern_and_turns(sessions, rng):
    order = list(range(len(sessions)))
    rng.shuffle(order)
    repaired = keep_turn_order(order, sessions)
    assert sorted(repaired) == list(range(len(sessions)))
    assert [sessions[i] for i in repaired] == [sessions[i] for i in order]  # same interleaving of sessions
    for session in set(sessions):
        mine = [i for i in repaired if sessions[i] == session]
        assert mine == sorted(mine)


def test_keep_turn_order_rejects_non_permutations():
    with pytest.raises(InvalidInputError):
        keep_turn_order([0, 0], ["a", "b"])


def test_popularity_sorts_by_frequency_then_first_seen():
    batch = PlanInput([["x", "a", "b"], ["b", "c"], ["c", "b", "a"], ["d"]], ["1", "2", "3", "4"], {}, False)
    plan = plan_popularity(batch)
    assert plan.order == [0, 1, 2, 3]
    assert plan.contexts == [["b", "a", "x"], ["b", "c"], ["b", "a", "c"], ["d"]]


def _segments(*keys, tokens=10):
    return [(key, tokens) for key in keys]


def test_lpm_runs_the_longest_cached_prefix_first():
    prompts = [_segments("s", "a", "b"), _segments("s", "x", "y"), _segments("s", "a", "b", "c"), _segments("s", "x")]
    order = LongestPrefixScheduler(capacity_tokens=10_000).order(prompts, ["1", "2", "3", "4"], multi_turn=False)
    assert order == [0, 2, 1, 3]  # after request 0, request 2 shares s,a,b; then 1 (ties: earliest arrival)


def test_lpm_respects_turn_order_and_window():
    prompts = [_segments("h1"), _segments("z"), _segments("h1", "h2"), _segments("h1", "h2", "h3")]
    sessions = ["s", "t", "s", "s"]
    order = LongestPrefixScheduler(10_000).order(prompts, sessions, multi_turn=True)
    assert sorted(order) == [0, 1, 2, 3]
    assert [i for i in order if sessions[i] == "s"] == [0, 2, 3]
    assert order[:3] == [0, 2, 3]  # the session's history stays cached, so its next turn always wins


def test_lpm_mirror_evicts_least_recently_used():
    prompts = [_segments("a"), _segments("b"), _segments("c"), _segments("a", "x")]
    roomy = LongestPrefixScheduler(capacity_tokens=1000, window=2).order(prompts, list("wxyz"), False)
    tight = LongestPrefixScheduler(capacity_tokens=10, window=2).order(prompts, list("wxyz"), False)
    assert roomy == [0, 1, 3, 2]  # "a" still cached: its extension jumps the queue
    assert tight == [0, 1, 2, 3]  # "a" was evicted by "b": nothing matches, arrival order decides


@pytest.mark.skipif(not contextpilot_available(), reason="contextpilot is not installed")
def test_contextpilot_wrapper_returns_permutations_and_an_order():
    contexts = [["a", "b", "c"], ["c", "b", "x"], [], ["y", "a", "b"], ["a", "b", "c"]]
    plan = plan_with_contextpilot(contexts)
    assert sorted(plan.order) == list(range(len(contexts)))
    for before, after in zip(contexts, plan.contexts):
        assert sorted(before) == sorted(after)
    assert plan_with_contextpilot(contexts) == plan  # a fresh instance each run: same result


def test_replay_degrades_when_the_peer_package_is_missing(monkeypatch):
    import sys

    from cpmemory.bench.loaders import load_synthetic
    from cpmemory_benchmarks.replay import ReplaySettings, run_replay

    monkeypatch.setitem(sys.modules, "contextpilot.server.live_index", None)  # import now fails
    trace = load_synthetic(requests=10, blocks_per_request=3, corpus_size=10)
    report = run_replay(trace, ReplaySettings(strategies=("original", "contextpilot")))
    assert set(report.results) == {"original"}
    assert "contextpilot" in report.unavailable and "pip install" in report.unavailable["contextpilot"]
