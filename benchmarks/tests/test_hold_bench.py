"""``cpmemory bench hold``: a small run with the queue off and on completes every request with nothing lost, and
the queue really holds when the clients outnumber the engine's slots."""
from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from cpmemory.bench.trace import TraceBlock, TraceRequest
from cpmemory.cli import app
from cpmemory_benchmarks.hold_bench import capacity_blocks, configurations, run_all, summarize

POOL = [TraceBlock(f"b{i}", f"Block {i}: " + f"evidence {i} of the topic. " * (3 + i % 5)) for i in range(12)]
REQUESTS = [TraceRequest(f"s{n}", 1, f"question {n}?", tuple(POOL[(n + k * 3) % 12] for k in range(3)))
            for n in range(24)]


def test_off_and_on_serve_every_request_and_the_queue_holds_when_slots_are_short():
    settings = {"clients": 8, "slots": 2, "service_ms": 2.0, "replicas": 1,
                "capacity_blocks": capacity_blocks(REQUESTS, 0.5, 16)}
    runs = asyncio.run(run_all(REQUESTS, settings, configurations([5.0], fcfs=True), rounds=1, quiet=True))
    assert [run["queue"] for run in runs] == ["off", "hold 5 ms", "hold 5 ms, fcfs"]
    for run in runs:
        assert run["requests"] == len(REQUESTS) and run["errors"] == 0 and run["lost"] == 0
        assert 0 < run["cached_share"] < 1 and run["prompt_tokens"] > 0
    on, fcfs = runs[1], runs[2]
    assert on["held"] > 0 and sum(on["releases"].values()) > 0
    assert on["releases"]["slot/fcfs"] + on["releases"]["timeout/fcfs"] < sum(on["releases"].values())
    assert fcfs["releases"]["slot/planner"] == fcfs["releases"]["timeout/planner"] == 0
    summary = summarize(runs)
    assert [row["queue"] for row in summary] == ["off", "hold 5 ms", "hold 5 ms, fcfs"]
    assert summary[0]["cached_shares"] == [runs[0]["cached_share"]]


def test_the_command_rejects_a_multi_turn_workload_and_a_bad_hold(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "hold", "--workload", "mt_rag", "--json"])
    assert result.exit_code == 2 and "independent requests" in result.output
    result = runner.invoke(app, ["bench", "hold", "--workload", "synthetic", "--hold-ms", "0", "--json"])
    assert result.exit_code == 2


def test_the_command_prints_one_json_object():
    result = CliRunner().invoke(app, ["bench", "hold", "--workload", "synthetic", "--requests", "16", "--clients", "4",
                                      "--slots", "1", "--service-ms", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["requests"] == 16 and [row["queue"] for row in report["summary"]] == ["off", "hold 5 ms"]
    assert all(row["lost"] == 0 and row["errors"] == 0 for row in report["summary"])
