"""bench replay --online: same run, every online strategy, the product's prepare path, gain shares, bad input."""
from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from cpmemory.bench.loaders import load_synthetic
from cpmemory.bench.results import StrategyResult
from cpmemory.bench.trace import Trace, TraceBlock, TraceRequest, write_trace
from cpmemory.cli import app
from cpmemory.errors import InvalidInputError
from cpmemory_benchmarks.online import ONLINE_STRATEGIES, Windows, gain_share, second_half
from cpmemory_benchmarks.replay import ReplaySettings, run_replay

ONLINE_KEYS = {"hit_rate", "prefill_tokens", "gain_share", "hit_rate_second_half", "gain_share_second_half",
               "overhead_p50_ms", "overhead_p99_ms", "no_loss_violations"}


@pytest.fixture(scope="module")
def trace():
    return load_synthetic(requests=150, blocks_per_request=6, corpus_size=60, seed=3)


@pytest.mark.parametrize("window", [1, 8])
def test_every_online_strategy_runs_without_loss_and_the_product_beats_original(trace, window):
    report = run_replay(trace, ReplaySettings(capacity="20%", strategies=("original", "popularity")),
                        online_window=window)
    assert "cpmemory" in report.results  # the offline planner always runs with --online
    online = report.to_json()["online"]
    assert online["window"] == window and set(online["strategies"]) == set(ONLINE_STRATEGIES)
    for name, figures in online["strategies"].items():
        assert figures.keys() >= ONLINE_KEYS, name
        assert figures["no_loss_violations"] == 0, name
    ours, original = online["strategies"]["cpmemory"], online["strategies"]["original"]
    assert ours["hit_rate"] > original["hit_rate"]
    offline = report.results["cpmemory"].hit_rate
    assert ours["gain_share"] == pytest.approx(gain_share(ours["hit_rate"], original["hit_rate"], offline), abs=1e-3)


def test_windows_cut_untimed_traces_and_follow_arrivals(trace):
    assert [len(w) for w in Windows(trace, 64)] == [64, 64, 22]
    timed = dataclasses.replace(trace, requests=tuple(
        dataclasses.replace(r, arrival=float(i // 3)) for i, r in enumerate(trace.requests[:9])))
    windows = Windows(timed, 8)
    seen = []
    for waiting in windows:
        seen.append(waiting)
        for _ in waiting:
            windows.busy(0)  # an idle engine: a window is what arrived at the same time
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_window_below_one_is_an_error_naming_the_flag(trace, tmp_path):
    with pytest.raises(InvalidInputError, match="--window"):
        run_replay(trace, ReplaySettings(strategies=("original",)), online_window=0)
    path = tmp_path / "t.jsonl"
    write_trace(Trace("t", trace.requests[:10]), path)
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(path), "--online", "--window", "0", "--json"])
    assert result.exit_code == 2 and "--window" in result.output


def test_cli_prints_the_online_object(tmp_path, trace):
    path = tmp_path / "t.jsonl"
    write_trace(Trace("t", trace.requests[:40]), path)
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(path), "--strategies", "original",
                                      "--online", "--json"])
    assert result.exit_code == 0, result.output
    line = [row for row in result.output.splitlines() if row.startswith("{")][-1]
    assert set(json.loads(line)["online"]["strategies"]) == set(ONLINE_STRATEGIES)


def _interleaved_clusters(clusters=6, per=12):
    """Requests of six clusters arriving in turn: each holds its own block first, then its cluster's three."""
    def words(tag):
        return " ".join(f"{tag}w{i}" for i in range(60))

    requests = []
    for number in range(per):
        for cluster in range(clusters):
            shared = tuple(TraceBlock(f"c{cluster}-s{s}", f"shared {cluster} {s} " + words(f"c{cluster}s{s}"))
                           for s in range(3))
            own = TraceBlock(f"c{cluster}-own{number}", f"own {cluster} {number} " + words(f"c{cluster}o{number}"))
            requests.append(TraceRequest(f"r{cluster}-{number}", 0, f"question {cluster} {number}", (own, *shared)))
    return Trace("clusters", tuple(requests), multi_turn=False)


def test_the_product_is_told_the_cache_size_and_plans_a_window_that_outgrows_it_as_a_batch():
    # a 20% cache holds about three prompts: in arrival order each cluster's prefix is evicted before its next
    # request (W=1: no better than original); a window of 24 is planned as a batch, clusters back to back
    trace = _interleaved_clusters()
    for window, floor in ((1, 0.0), (24, 0.4)):
        report = run_replay(trace, ReplaySettings(capacity="20%", strategies=("original",)), online_window=window)
        online = report.to_json()["online"]["strategies"]
        ours = online.pop("cpmemory")
        assert ours["no_loss_violations"] == 0
        assert ours["hit_rate"] >= floor
        if window > 1:
            assert all(ours["hit_rate"] > other["hit_rate"] + 0.2 for other in online.values())


def test_hit_rate_of_counts_requests_by_trace_position_wherever_they_ran():
    result = StrategyResult("s")
    for index, cached, prompt in ((2, 90, 100), (0, 0, 100), (3, 10, 300), (1, 50, 100)):  # execution order
        result.record({"dedup_saved": 0, "annotation": 0}, prompt, cached, index)
    assert result.hit_rate_of(second_half(4)) == pytest.approx((90 + 10) / (100 + 300))  # requests 2 and 3
    assert result.hit_rate_of(range(2)) == pytest.approx(50 / 200)
    assert result.hit_rate_of(range(0)) == 0.0
    assert list(second_half(5)) == [2, 3, 4]
    result.record({"dedup_saved": 0, "annotation": 0}, 10, 0)  # served without its index
    with pytest.raises(ValueError, match="index"):
        result.hit_rate_of(second_half(5))


def test_the_second_half_of_a_repeated_trace_finds_every_prompt_cached(trace):
    # the second half repeats the first; a cache that holds every prompt serves each repeat whole (the simulator
    # leaves the prompt's last token to compute): the second-half hit rate is known by hand, the whole trace's is lower
    first = trace.requests[:20]
    repeated = Trace("repeated", first + tuple(dataclasses.replace(r, session=f"{r.session}-again") for r in first),
                     multi_turn=False)
    report = run_replay(repeated, ReplaySettings(capacity="100000%", strategies=("original",)), online_window=1)
    online = report.to_json()["online"]
    original = report.online.results["original"]
    assert original.request_indices == list(range(40))  # first come first served
    later = original.prompt_per_request[20:]
    expected = 1.0 - 20 / sum(later)
    figures = online["strategies"]
    assert figures["original"]["hit_rate_second_half"] == pytest.approx(expected, abs=1e-6)
    assert figures["original"]["hit_rate"] < expected - 0.2
    for name in ONLINE_STRATEGIES:
        assert figures[name]["hit_rate_second_half"] > figures[name]["hit_rate"], name
    # the share over the second half is taken against the offline planner's and original's second halves
    offline_second = report.results["cpmemory"].hit_rate_of(range(20, 40))
    assert online["offline_cpmemory_hit_rate_second_half"] == pytest.approx(offline_second, abs=1e-6)
    assert report.online.gain_shares_second_half["cpmemory"] == pytest.approx(gain_share(
        report.online.hit_rates_second_half["cpmemory"], expected, offline_second))
