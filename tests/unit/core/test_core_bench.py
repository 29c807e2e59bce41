"""`cpmemory bench core`: the workload is seeded and realistic, the command prints the JSON contract."""

from __future__ import annotations

import json
from collections import Counter

from typer.testing import CliRunner

from cpmemory.bench.core_bench import WorkloadSpec, make_workload
from cpmemory.cli import app

REQUIRED_KEYS = {
    "contexts",
    "k",
    "build_seconds",
    "search_p50_ms",
    "search_p99_ms",
    "reorder_p50_ms",
    "dedup_p50_ms",
    "peak_rss_mb",
}


def test_the_workload_is_seeded_and_overlapping() -> None:
    spec = WorkloadSpec(contexts=400, k=10, seed=3)
    first, again = make_workload(spec), make_workload(spec)
    assert first == again
    assert make_workload(WorkloadSpec(contexts=400, k=10, seed=4)) != first
    assert all(len(context) == 10 == len(set(context)) for context in first)
    popularity = Counter(key for context in first for key in context)
    top = sum(count for _, count in popularity.most_common(len(popularity) // 5))
    assert top / sum(popularity.values()) > 0.5  # Zipf: the 20% most used blocks carry most of the uses


def test_bench_core_prints_one_json_object() -> None:
    result = CliRunner().invoke(
        app, ["bench", "core", "--contexts", "600", "--k", "8", "--seed", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures.keys() >= REQUIRED_KEYS
    assert figures["contexts"] == 600 and figures["k"] == 8
    assert figures["build_seconds"] > 0 and figures["search_p50_ms"] > 0 and figures["dedup_p50_ms"] > 0
    assert figures["search_p99_ms"] >= figures["search_p50_ms"]


def test_bench_core_prints_a_table() -> None:
    result = CliRunner().invoke(app, ["bench", "core", "--contexts", "300", "--k", "5"])
    assert result.exit_code == 0, result.output
    assert "search_p50_ms" in result.stdout and "build_seconds" in result.stdout


def test_queries_draw_from_the_same_popular_blocks() -> None:
    spec = WorkloadSpec(contexts=500, k=10, seed=2)
    batch, queries = make_workload(spec), make_workload(spec, count=200, stream=1)
    popular = {key for key, _ in Counter(key for context in batch for key in context).most_common(20)}
    assert sum(1 for query in queries if popular & set(query)) > 0.8 * len(queries)
