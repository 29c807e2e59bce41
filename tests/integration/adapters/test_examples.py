"""The two examples run offline end to end (small settings) and report consistent figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from cpmemory.bench.loaders import default_data_dir

ROOT = Path(__file__).resolve().parents[3]
DATA = default_data_dir(ROOT)  # ../shared/data beside the checkout, else /work/shared/data (a clone elsewhere, as in CI)


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_langgraph_rag_example(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("langgraph")
    example = _example("langgraph_rag")
    totals = example.run("example-test")
    out = capsys.readouterr().out
    assert totals["turns"] == len(example.QUESTIONS)
    assert totals["tokens_referenced"] > 0 and totals["tokens_full"] > 0
    assert "is shown earlier in this conversation" in out
    assert f"{2 * len(example.QUESTIONS)} messages kept by the checkpointer" in out
    assert totals["over_budget"] == 0 and 0 < totals["prompt_tokens_max"] <= example.BUDGET
    assert f"token budget: {example.BUDGET} per prompt" in out


def test_mem0_chat_example_on_locomo(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mem0")
    pytest.importorskip("langchain")
    if not (DATA / "locomo" / "locomo10.json").exists():
        pytest.skip(f"LoCoMo data not found under {DATA}")
    example = _example("mem0_chat")
    code = example.main(
        ["--data-dir", str(DATA), "--sessions", "2", "--questions", "4", "--top-k", "6", "--json"]
    )
    assert code == 0
    out = capsys.readouterr().out
    totals = json.loads(out.strip().splitlines()[-1])
    assert totals["questions"] == 4 and totals["memories"] == 24
    assert totals["full"] + totals["referenced"] == totals["memories"]
    assert totals["referenced"] > 0 and totals["memory_tokens_referenced"] > 0
    assert "sent in full" in out
    assert totals["budget"] == 8000 and totals["over_budget"] == 0 and "token budget: 8000" in out
    args = ["--data-dir", str(DATA), "--sessions", "2", "--questions", "4", "--top-k", "6", "--json"]
    assert example.main([*args, "--history-turns", "1"]) == 0
    windowed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert windowed["history_turns"] == 1
    assert windowed["full"] + windowed["referenced"] == windowed["memories"]
    # one turn of history instead of up to three
    assert windowed["prompt_cpmemory"] < totals["prompt_cpmemory"]
