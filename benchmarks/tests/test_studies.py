"""The studies (cpmemory_benchmarks.studies) on small seeded traces: each row means what its docstring says."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from rich.progress import Progress

from cpmemory.bench.loaders import load_synthetic
from cpmemory.bench.offline import ReplaySettings
from cpmemory.bench.trace import Trace
from cpmemory_benchmarks import online
from cpmemory_benchmarks.bounds import exact_trie_optimum, mst_block_reuse
from cpmemory_benchmarks.replay import run_replay
from cpmemory_benchmarks.studies import online_ceiling, planner_ceiling, token_estimate, window_sweep


def small_trace(seed: int = 0) -> Trace:
    return load_synthetic(requests=40, blocks_per_request=5, corpus_size=60, seed=seed)


def test_online_ceiling_plain_row_is_the_online_replays_original() -> None:
    trace = small_trace()
    plain = online_ceiling._hit(trace, online._Plain, "20%")
    report = run_replay(trace, ReplaySettings(capacity="20%", strategies=("original",)), online_window=1)
    assert report.online is not None
    assert plain == pytest.approx(report.online.results["original"].hit_rate)
    assert 0.0 <= online_ceiling._hit(trace, online_ceiling._Orderer, "20%") <= 1.0


def test_planner_ceiling_planner_never_beats_the_exact_optimum_nor_it_the_mst_bound() -> None:
    contexts, texts = planner_ceiling.contexts_of(small_trace(1))
    weights = {key: float(len(planner_ceiling.block_tokens(text))) for key, text in texts.items()}
    rng = np.random.default_rng(0)
    for how in ("near", "random"):
        sub = planner_ceiling.sample(contexts, weights, 8, how, rng)
        optimum = exact_trie_optimum(sub, weights)
        assert planner_ceiling.planned_reuse(sub, weights) <= optimum + 1e-9
        assert optimum <= mst_block_reuse(sub, weights) + 1e-9


def test_window_sweep_reports_each_window_and_the_smallest_that_reaches_a_target(monkeypatch) -> None:
    monkeypatch.setattr(window_sweep, "load_workload", lambda name, data_dir: small_trace(2))
    with Progress(console=Console(quiet=True)) as progress:
        result: dict[str, Any] = window_sweep.sweep("synthetic", [1, 8], "20%", None, progress, Console(quiet=True))
    rows = result["windows"]
    assert [row["window"] for row in rows] == [1, 8]
    assert all(row["no_loss_violations"] == 0 for row in rows)
    best = max(row["gain_share"] for row in rows)
    assert window_sweep.smallest_window(rows, "gain_share", best) == next(
        row["window"] for row in rows if row["gain_share"] >= best)
    assert window_sweep.smallest_window(rows, "gain_share", best + 1.0) is None
    json.dumps(result)


def test_token_estimate_compare_and_texts(tmp_path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"x": ["a short one", "a string long enough to count here"]}))
    (tmp_path / "b.jsonl").write_text(json.dumps({"y": "another string of twenty characters"}) + "\n")
    assert sorted(token_estimate.texts(tmp_path)) == ["a string long enough to count here",
                                                       "another string of twenty characters"]
    row = token_estimate.compare(["abcdefgh", "abcd"], lambda text: len(text) // 4, lambda text: len(text) // 2)
    assert row == {"texts": 2, "worst": 2.0, "under_counted": 2, "total": 2.0}
