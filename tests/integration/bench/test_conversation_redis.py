"""``cpmemory bench conversation --backend redis`` (issue 13): the JSON on the real Redis, bytes per conversation bounded."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cpmemory.cli import app


@pytest.mark.redis
def test_cli_json_on_redis_reports_bounded_bytes() -> None:
    result = CliRunner().invoke(app, ["bench", "conversation", "--turns", "250", "--budget", "5000", "--backend",
                                      "redis", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["over_budget"] == 0 and summary["no_loss_violations"] == 0
    samples = summary["redis_bytes_samples"]
    assert summary["redis_bytes_per_conversation"] == max(samples) < 200_000
