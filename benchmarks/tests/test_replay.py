"""Replay end to end on small traces, through the API and the CLI."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cpmemory.bench.demo import run_demo
from cpmemory.bench.loaders import load_synthetic
from cpmemory.bench.offline import ReplaySettings, resolve_capacity
from cpmemory.bench.prompts import chat_tokens, message_tokens
from cpmemory.bench.tokenizer import tokenize, tokenize_chat
from cpmemory.bench.trace import write_trace
from cpmemory.cli import app
from cpmemory.errors import InvalidInputError
from cpmemory_benchmarks.replay import run_replay
from cpmemory_benchmarks.strategies import STRATEGIES

KEYS = {"hit_rate", "prompt_tokens", "prefill_tokens", "dedup_tokens_saved", "annotation_tokens",
        "overhead_p50_ms", "overhead_p99_ms"}


@pytest.fixture(scope="module")
def small_trace():
    return load_synthetic(requests=120, blocks_per_request=6, corpus_size=60, seed=7)


@pytest.fixture(scope="module")
def multi_turn_trace():
    return load_synthetic(requests=48, blocks_per_request=5, corpus_size=40, seed=2, turns_per_session=4)


def test_every_strategy_runs_without_loss_and_cpmemory_beats_original(small_trace):
    report = run_replay(small_trace, ReplaySettings(capacity="20%", strategies=STRATEGIES))
    assert report.results["original"].hit_rate < report.results["cpmemory"].hit_rate
    for name, result in report.results.items():
        assert result.violations == [], name
        assert result.prompt_tokens > 0 and len(result.cached_per_request) == 120
    same_content = {r.prompt_tokens - r.annotation_tokens for r in report.results.values()}
    assert max(same_content) - min(same_content) <= 120 * 2  # same prompts apart from order (seams +-1 token)
    assert report.capacity_tokens == round(report.unique_tokens * 0.2)


def test_multi_turn_dedup_reaches_its_bound_and_never_prefills_more(multi_turn_trace):
    report = run_replay(multi_turn_trace, ReplaySettings(capacity="20%", strategies=("original", "cpmemory")))
    original, ours = report.results["original"], report.results["cpmemory"]
    assert report.bounds.dedup_bound_tokens > 0
    assert ours.dedup_tokens_saved >= 0.95 * report.bounds.dedup_bound_tokens
    assert ours.violations == [] and original.violations == []
    assert ours.prompt_tokens - ours.cached_tokens <= original.prompt_tokens - original.cached_tokens
    assert ours.hit_rate >= original.hit_rate


def test_a_roomy_cache_never_hits_less(small_trace):
    tight = run_replay(small_trace, ReplaySettings(capacity="10%", strategies=("original",)))
    roomy = run_replay(small_trace, ReplaySettings(capacity="500%", strategies=("original",)))
    assert roomy.results["original"].cached_tokens >= tight.results["original"].cached_tokens
    assert roomy.results["original"].hit_rate <= roomy.bounds.oracle_hit_rate


def test_capacity_parsing():
    assert resolve_capacity("20%", 1000) == 200 and resolve_capacity(512, 10) == 512
    for bad in ("-5", "abc", "-1%"):
        with pytest.raises(InvalidInputError):
            resolve_capacity(bad, 100)
    with pytest.raises(InvalidInputError, match="unknown strategies"):
        run_replay(load_synthetic(requests=2, blocks_per_request=1, corpus_size=2), ReplaySettings(strategies=("x",)))


def test_cli_json_has_the_issue_keys(tmp_path, multi_turn_trace):
    path = tmp_path / "t.jsonl"
    write_trace(multi_turn_trace, path)
    plot = tmp_path / "p.png"
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(path), "--capacity", "30%", "--json",
                                      "--strategies", "original,popularity,cpmemory", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"workload", "requests", "capacity_tokens", "strategies", "oracle_hit_rate", "mst_bound_hit_rate",
            "dedup_bound_tokens"} <= set(figures)
    assert set(figures["strategies"]) == {"original", "popularity", "cpmemory"}
    assert all(set(row) >= KEYS for row in figures["strategies"].values())
    assert figures["requests"] == 48 and figures["multi_turn"] is True
    assert plot.stat().st_size > 10_000


def test_cli_table_and_bad_trace(tmp_path):
    good = {"session": "s", "turn": 1, "query": "q", "blocks": [{"id": "a", "text": "alpha beta"}]}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + "{broken\n" + json.dumps({**good, "turn": 2}) + "\n")
    runner = CliRunner()
    failed = runner.invoke(app, ["bench", "replay", "--trace", str(path), "--strategies", "original"])
    assert failed.exit_code == 2 and "trace line 2" in failed.output
    skipped = runner.invoke(app, ["bench", "replay", "--trace", str(path), "--strategies", "original", "--skip-bad"])
    assert skipped.exit_code == 0, skipped.output
    assert "skipped" in skipped.output and "original" in skipped.output and "MST" in skipped.output


def test_cli_missing_data_dir_names_the_path(tmp_path):
    result = CliRunner().invoke(app, ["bench", "replay", "--workload", "multihop", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "multihop_rag" in result.output and "queries_500.json" in result.output


def test_demo_is_seeded_and_lossless():
    first = run_demo(seed=1)
    assert first["strategies"]["cpmemory"]["no_loss_violations"] == 0
    assert first["strategies"]["original"]["no_loss_violations"] == 0
    assert first["seed"] == 1 and first["requests"] == 96
    assert first["strategies"]["cpmemory"]["prefill_tokens"] < first["strategies"]["original"]["prefill_tokens"]
    assert first["strategies"]["cpmemory"]["dedup_tokens_saved"] > 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(st.sampled_from("ab [\n]D1x,.'s_é\t"), max_size=30), min_size=1, max_size=6))
def test_sectioned_tokenization_equals_the_tokenizer(parts):
    text = "\n".join(parts)
    assert message_tokens(text) == tokenize(text)
    messages = [{"role": "system", "content": parts[0]}, {"role": "user", "content": text}]
    assert chat_tokens(messages) == tokenize_chat(messages)


def test_engine_replay_reports_real_figures_beside_the_simulated_ones():
    from cpmemory.testing.mock_engine import MockEngine
    from cpmemory_benchmarks.replay import replay_on_engine

    trace = load_synthetic(requests=30, blocks_per_request=4, corpus_size=20, seed=5)
    report = run_replay(trace, ReplaySettings(capacity="200%", strategies=("original", "cpmemory"),
                                              keep_prompts=True))
    engine = MockEngine(block_size=16, capacity_blocks=100_000)
    replay_on_engine(report, "http://mock", transport=engine.transport())
    for name, result in report.results.items():
        real = result.summary()["real"]
        assert real["requests"] == 30 and real["prompt_tokens"] > 0, name
        assert real["cached_tokens"] > 0 and real["ttft_mean_ms"] is not None, name
    ours, original = report.results["cpmemory"].real, report.results["original"].real
    assert ours["cache_hit_ratio"] >= original["cache_hit_ratio"]  # the engine agrees with the simulator's ranking
