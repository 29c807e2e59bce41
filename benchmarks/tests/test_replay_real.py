"""replay_real.measure against the mock engine (the real-engine figures come from test_vllm_real.py)."""
from __future__ import annotations

import pytest

from cpmemory.errors import EngineError
from cpmemory.testing.mock_engine import MockEngine, mock_tokenize, render_chatml
from cpmemory_benchmarks.replay_real import measure, replay_real, summarize

SHARED = "shared context " * 20


def prompt(question: str, shared_first: bool) -> list[dict[str, str]]:
    body = f"{SHARED}\n{question}" if shared_first else f"{question}\n{SHARED}"
    return [{"role": "user", "content": body}]


def test_shared_prefix_first_is_cached_and_faster():
    engine = MockEngine(block_size=16, capacity_blocks=1000, prefill_s_per_token=0.0002)
    questions = [f"question number {n}?" for n in range(5)]
    late = measure([prompt(q, False) for q in questions], "http://mock", transport=engine.transport())
    early = measure([prompt(q, True) for q in questions], "http://mock", transport=engine.transport())
    assert late["cached_tokens"] < early["cached_tokens"]  # only the chat header and "question number " are shared
    expected_prompt = sum(len(mock_tokenize(render_chatml(prompt(q, True)))) for q in questions)
    assert early["prompt_tokens"] == late["prompt_tokens"] == expected_prompt
    assert early["cached_tokens"] == sum(r["cached_tokens"] for r in engine.requests[-5:]) > 0
    assert early["ttft_total_ms"] < late["ttft_total_ms"]
    assert early["requests"] == 5 and early["reset"] is True
    assert 0 < early["cache_hit_ratio"] < 1


def test_reset_makes_runs_independent_and_ids_are_sent():
    engine = MockEngine(block_size=16)
    prompts = [prompt("a", True), prompt("b", True)]
    first = measure(prompts, "http://mock", transport=engine.transport(), request_ids=["x1", "x2"])
    second = measure(prompts, "http://mock", transport=engine.transport())
    assert first["cached_tokens"] == second["cached_tokens"]
    assert [r["request_id"] for r in engine.requests[:2]] == ["x1", "x2"]
    kept = measure(prompts, "http://mock", transport=engine.transport(), reset_cache=False)
    assert kept["cached_tokens"] > first["cached_tokens"]


def test_refused_reset_and_failures_raise():
    engine = MockEngine()
    engine.refuse_resets(100)
    with pytest.raises(EngineError, match="reset_prefix_cache"):
        measure([prompt("a", True)], "http://mock", transport=engine.transport())
    engine = MockEngine()
    engine.fail_next(1, status=500)  # an error status is a refusal, not retried
    with pytest.raises(EngineError):
        measure([prompt("a", True)], "http://mock", transport=engine.transport())
    with pytest.raises(ValueError):
        measure([prompt("a", True)], "http://mock", request_ids=[])


def test_progress_and_alias():
    engine = MockEngine()
    seen = []
    figures = replay_real("http://mock", [prompt("a", True)] * 3, transport=engine.transport(),
                          progress=lambda done, total, result: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)] and figures["requests"] == 3


def test_summarize_empty():
    figures = summarize([])
    assert figures["ttft_mean_ms"] is None and figures["prompt_tokens"] == 0 and figures["cache_hit_ratio"] == 0.0
