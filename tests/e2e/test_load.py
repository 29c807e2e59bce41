"""The load generator end to end (small): real uvicorn proxy on loopback, mock engines, no-loss check per request."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from cpmemory.bench.load import make_pool, percentile, turn_blocks
from cpmemory.cli import app


def test_bench_load_json_reports_no_errors_and_no_lost_blocks() -> None:
    result = CliRunner().invoke(app, ["bench", "load", "--conversations", "30", "--turns", "2", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["conversations"] == 30 and figures["requests"] == 60
    assert figures["errors"] == 0 and figures["lost_blocks"] == 0 and figures["unchecked_requests"] == 0
    assert figures["replica_changes"] == 0  # one conversation's turns stay on one replica
    assert figures["tokens_deduplicated"] > 0 and figures["cached_tokens"] > 0
    for key in ("overhead_p50_ms", "overhead_p99_ms", "throughput_rps"):
        assert figures[key] > 0


def test_workload_helpers() -> None:
    import random

    pool = make_pool(48, 100, seed=1)
    assert len({block["id"] for block in pool}) == 48 and all(len(b["text"]) >= 100 for b in pool)
    rng = random.Random(0)
    first = turn_blocks(rng, pool, [], 8)
    second = turn_blocks(rng, pool, first, 8)
    assert len(first) == len(second) == 8 and len({b["id"] for b in second}) == 8
    assert len({b["id"] for b in first} & {b["id"] for b in second}) >= 3
    assert percentile([], 0.5) == 0.0 and percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile(list(range(100)), 0.99) == 98
