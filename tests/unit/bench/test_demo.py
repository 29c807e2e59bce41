"""``cpmemory demo``: the online path beside the offline planner, on a tight cache and on one that never evicts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cpmemory.bench.demo import TERMS, run_demo
from cpmemory.cli import app


@pytest.fixture(scope="module")
def figures() -> dict:
    return run_demo(seed=3)


def test_both_paths_on_both_caches_without_loss(figures: dict) -> None:
    for path in ("online", "offline"):
        assert set(figures[path]) == {"tight", "working_set"}
        for cache in figures[path].values():
            for summary in cache["strategies"].values():
                assert summary["no_loss_violations"] == 0
    tight, roomy = figures["online"]["tight"], figures["online"]["working_set"]
    assert tight["capacity_tokens"] == figures["capacity_tokens"] < roomy["capacity_tokens"]
    assert roomy["capacity_tokens"] >= max(
        s["prompt_tokens"] for path in ("online", "offline") for s in figures[path]["tight"]["strategies"].values()
    )


def test_online_is_what_prepare_gives_not_the_planner(figures: dict) -> None:
    online = figures["online"]["tight"]["strategies"]
    offline = figures["offline"]["tight"]["strategies"]
    # the same plain baseline (first come first served, retrieval order) in both paths
    assert online["original"]["prefill_tokens"] == offline["original"]["prefill_tokens"]
    # de-duplication works online too; the planner's schedule is what the online path lacks on a tight cache
    assert online["cpmemory"]["dedup_tokens_saved"] > 0
    assert online["cpmemory"]["prefill_tokens"] < online["original"]["prefill_tokens"]
    assert offline["cpmemory"]["prefill_tokens"] < online["cpmemory"]["prefill_tokens"]


def test_a_cache_holding_the_working_set_raises_plain_caching_most(figures: dict) -> None:
    tight, roomy = figures["online"]["tight"]["strategies"], figures["online"]["working_set"]["strategies"]
    assert roomy["original"]["hit_rate"] > tight["original"]["hit_rate"]
    assert roomy["cpmemory"]["hit_rate"] >= tight["cpmemory"]["hit_rate"]
    assert figures["online"]["working_set"]["prefill_reduction"] < figures["offline"]["tight"]["prefill_reduction"]


def test_json_keeps_the_earlier_keys_and_the_table_explains_every_term(
    figures: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cpmemory.bench.demo as demo

    monkeypatch.setattr(demo, "run_demo", lambda seed: figures)  # the figures above: the command's output only
    runner = CliRunner()
    result = runner.invoke(app, ["demo", "--json", "--seed", "3"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("strategies", "prefill_reduction", "capacity_tokens", "requests", "online", "offline"):
        assert key in payload
    table = runner.invoke(app, ["demo", "--seed", "3"])
    assert table.exit_code == 0, table.output
    text = " ".join(table.stdout.split())
    for column in ("plain prefix cache", "cpmemory online", "offline planner", "tight cache", "working-set cache"):
        assert column in text
    for term, _meaning in TERMS:
        assert f"{term}:" in text
