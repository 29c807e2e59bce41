"""``cpmemory bench store``: the JSON contract of its output, on a tiny workload."""
from __future__ import annotations

import json
from itertools import pairwise

import pytest
from typer.testing import CliRunner

from cpmemory.bench.store_bench import make_workload
from cpmemory.cli import app

ROW_KEYS = {"backend", "conversations", "turns", "round_trips_per_prepare", "round_trips_per_commit",
            "prepare_p50_ms", "prepare_p99_ms", "commit_p50_ms", "turns_per_second"}


def test_workload_overlaps_across_turns_and_is_deterministic() -> None:
    workload = make_workload(conversations=4, turns=5, seed=3)
    assert workload.turns == make_workload(conversations=4, turns=5, seed=3).turns
    for conversation in workload.turns:
        assert all(len(turn) == 15 and len({b.id for b in turn}) == 15 for turn in conversation)
        repeated = sum(len({b.id for b in a} & {b.id for b in c}) for a, c in pairwise(conversation))
        assert repeated >= 4 * 5  # about half of each turn was already retrieved in the previous one


@pytest.mark.redis
@pytest.mark.cluster
def test_bench_store_json_rows(real_redis: str) -> None:
    result = CliRunner().invoke(app, ["bench", "store", "--conversations", "3", "--turns", "2",
                                      "--facade-conversations", "2", "--shared-state", "300",
                                      "--redis-url", real_redis, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    rows = summary["results"]
    assert set(rows) == {"memory", "redis", "cluster"}
    for name, row in rows.items():
        if "skipped" in row:
            assert name == "cluster"
            continue
        assert set(row) >= ROW_KEYS and row["backend"] == name
        assert (row["conversations"], row["turns"]) == (3, 2)
        assert row["prepare_p50_ms"] > 0 and row["turns_per_second"] > 0
    assert rows["memory"]["round_trips_per_prepare"] == 0
    fractions = {row["seen_fraction"] for row in rows.values() if "skipped" not in row}
    assert len(fractions) == 1 and 0 < fractions.pop() < 1  # every store saw the same blocks as already shown
    assert (rows["redis"]["round_trips_per_prepare"], rows["redis"]["round_trips_per_commit"]) == (1.0, 1.0)
    for name in ("redis", "cluster"):
        row = rows[name]
        if "skipped" in row:
            continue
        assert row["shared_state_requests"] == 300 and row["facade_requests"] == 4 and row["facade_fallbacks"] == 0
        assert row["facade_prepare_p50_ms"] > 0 and row["facade_prepare_p99_ms"] >= row["facade_prepare_p50_ms"]
        assert row["facade_memory_prepare_p50_ms"] > 0  # the in-memory facade phase of the same run
        assert row["facade_added_p50_ms"] == pytest.approx(row["facade_prepare_p50_ms"]
                                                           - row["facade_memory_prepare_p50_ms"], abs=1e-3)
        assert row["facade_first_turn_prepare_p50_ms"] > 0 and "facade_first_turn_added_p50_ms" in row
        assert row["facade_prepare_over_memory"] > 0
        assert 300 * 100 < row["tenant_memory_bytes"] < 300 * 10_000  # about 1 KB per recorded order
        assert row["decision_max_requests"] == 100_000
    assert rows["redis"]["facade_round_trips_per_request"] == 2.0  # prepare + commit, on the socket
    if "skipped" not in rows["cluster"]:  # the conversation's and the tenant's keys on one node: one pipeline each
        assert rows["cluster"]["facade_round_trips_per_request"] == 2.0
        assert (rows["cluster"]["round_trips_per_prepare"], rows["cluster"]["round_trips_per_commit"]) == (1.0, 1.0)
    assert rows["memory"]["facade_fallbacks"] == 0 and rows["memory"]["shared_state_requests"] == 0
