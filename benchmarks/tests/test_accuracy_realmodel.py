"""Smoke test of the accuracy study on a real instruction-tuned model (``scripts/real_model.sh up qwen-0.5b``).

A few questions of MultiHop-RAG (single turn, one of them yes/no) and the first turns of a LoCoMo chat (through the
Mem0 adapter) under every condition: nothing lost, no error, every answer non-empty. Skipped unless
``CPM_REAL_MODEL_URL`` names the server (``scripts/real_model.sh env qwen-0.5b``).
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from cpmemory.bench.loaders import default_data_dir
from cpmemory_benchmarks import accuracy_data
from cpmemory_benchmarks.accuracy import summarize
from cpmemory_benchmarks.accuracy_prompts import CONDITIONS, build_prompts
from cpmemory_benchmarks.accuracy_run import ChatEngine, RecordFile, ask_all, latest, served_model

URL = os.environ.get("CPM_REAL_MODEL_URL")
pytestmark = [pytest.mark.realmodel, pytest.mark.skipif(not URL, reason="CPM_REAL_MODEL_URL is not set")]


def _smoke_prompts(data_dir: Path) -> list:
    multihop = accuracy_data.load("multihop", data_dir)
    free = next(chat for chat in multihop if chat[0].kind == "free")
    yesno = next(chat for chat in multihop if chat[0].kind == "yesno")
    locomo = accuracy_data.load("locomo", data_dir)[0][:2]
    return (build_prompts([free, yesno], plan_over=multihop)
            + build_prompts([locomo], via_mem0=True))


@pytest.mark.timeout(1200)  # a dozen real prefills on one CPU core
def test_a_few_questions_answered_under_every_condition(tmp_path: Path) -> None:
    assert URL is not None
    data_dir = default_data_dir(Path(__file__).resolve().parents[2])
    if not (data_dir / "multihop_rag").is_dir() or not (data_dir / "locomo").is_dir():
        pytest.skip(f"the datasets are not at {data_dir}")
    prompts = _smoke_prompts(data_dir)
    records = RecordFile(tmp_path / "smoke.jsonl")

    async def go() -> str:
        model = await served_model(URL)
        engine = ChatEngine(URL, model, max_tokens=32)
        try:
            todo = [p for by_condition in prompts for p in by_condition.values()]
            await ask_all([engine], todo, records)
        finally:
            await engine.aclose()
        return model

    model = asyncio.run(go())
    done = latest(records.load(), model)
    assert len(done) == len(prompts) * len(CONDITIONS)
    assert [r.error for r in done.values() if r.error] == []
    assert all(r.answer.strip() for r in done.values())
    figures = summarize(prompts, done)
    assert (figures["errors"], figures["empty"], figures["lost"]) == (0, 0, 0)
    assert figures["n"] == len(prompts)
