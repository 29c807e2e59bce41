"""bench load's figures: the proxy's overhead and admission's waits are reported apart."""
from __future__ import annotations

from cpmemory.bench.load import LoadStats, _account, _figures


def test_waits_are_reported_apart_from_the_overhead() -> None:
    stats = LoadStats(requests=2)
    _account(stats, {"overhead_ms": 1.5, "wait_ms": 0.0, "replica": 0}, None)
    _account(stats, {"overhead_ms": 2.5, "wait_ms": 300.0, "replica": 0}, 0)
    figures = _figures(stats, conversations=2, turns=1, wall=1.0)
    assert figures["overhead_p99_ms"] == 2.5 and figures["overhead_mean_ms"] == 2.0
    assert figures["wait_p99_ms"] == 300.0 and figures["wait_mean_ms"] == 150.0 and figures["wait_p50_ms"] == 0.0
