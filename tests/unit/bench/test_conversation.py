"""``cpmemory bench conversation`` (issue 13): the JSON contract and its figures on a short run."""

from __future__ import annotations

from cpmemory.bench import conversation

ISSUE_KEYS = ("turns", "budget", "over_budget", "no_loss_violations", "p50_first_ms", "p50_last_ms",
              "p50_last_over_first", "prefill_tokens", "prefill_sliding_tokens", "prefill_vs_sliding",
              "redis_bytes_per_conversation")


def test_workload_is_seeded_and_shaped() -> None:
    first, again = conversation.make_workload(30, seed=4), conversation.make_workload(30, seed=4)
    assert first == again and first != conversation.make_workload(30, seed=5)
    assert all(len(turn.blocks) == conversation.MEMORIES_PER_TURN for turn in first)
    assert all(len({b["id"] for b in turn.blocks}) == conversation.MEMORIES_PER_TURN for turn in first)
    assert 450 <= sum(len(b["text"]) for b in first[0].blocks) / len(first[0].blocks) <= 600


def test_short_run_fits_the_budget_and_beats_the_sliding_window() -> None:
    summary = conversation.run(200, 6000, "memory", "", 8, 0, lambda message: None)
    assert all(key in summary for key in ISSUE_KEYS)
    assert summary["over_budget"] == 0 and summary["no_loss_violations"] == 0
    assert summary["prompt_tokens_max"] <= 6000 < summary["turn_window_over_budget"] * 6000
    assert summary["prefill_vs_sliding"] < 0.6 and summary["window_restarts"] > 10
    assert [band["turns"] for band in summary["bands"]] == ["1-100", "101-200"]
