"""Every example in examples/ runs offline end to end, as a user runs it (a subprocess, small settings).

The subprocess refuses any connection that leaves the machine (a ``sitecustomize`` that guards ``socket.connect``),
so an example that reached a model hub or telemetry would fail here rather than pass on a networked CI runner.
LangGraph runs with ``LANGGRAPH_STRICT_MSGPACK=true``: a checkpoint holding a type outside its allowlist fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpmemory.bench.loaders import default_data_dir

ROOT = Path(__file__).resolve().parents[3]
DATA = default_data_dir(ROOT)  # ../shared/data beside the checkout, else /work/shared/data (a clone elsewhere, as in CI)
EXAMPLES = sorted(path.name for path in (ROOT / "examples").glob("*.py"))
TESTED_ELSEWHERE = {"openai_proxy.py": "tests/e2e/test_openai_quickstart.py"}  # needs a proxy and an engine running

GUARD = '''
import socket

_connect = socket.socket.connect
LOCAL = ("127.0.0.1", "::1", "localhost")


def _offline_connect(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, str) and host not in LOCAL and self.family != socket.AF_UNIX:
        raise OSError(f"examples test: network refused ({address!r})")
    return _connect(self, address)


socket.socket.connect = _offline_connect
'''


def _run(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    guard = tmp_path / "guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(GUARD, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": str(guard),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MEM0_TELEMETRY": "false",
        "LANGGRAPH_STRICT_MSGPACK": "true",
        "HOME": str(tmp_path),  # nothing written to the real home folder
    }
    return subprocess.run(
        [sys.executable, "-W", "error::UserWarning:langgraph", str(ROOT / "examples" / name), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )


def test_every_example_is_covered() -> None:
    tested_here = {"langgraph_rag.py", "mem0_chat.py"}
    assert set(EXAMPLES) == tested_here | set(TESTED_ELSEWHERE), "add a test for the new example"
    for test in TESTED_ELSEWHERE.values():
        assert (ROOT / test).is_file(), test


def test_the_guard_refuses_the_network(tmp_path: Path) -> None:
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD, encoding="utf-8")
    probe = "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=1)\nexcept OSError as e:\n    print(e)"
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(guard)},
                          capture_output=True, text=True, timeout=60)
    assert "network refused" in done.stdout


def test_langgraph_rag_example(tmp_path: Path) -> None:
    pytest.importorskip("langgraph")
    done = _run(tmp_path, "langgraph_rag.py")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "is shown earlier in this conversation" in out
    assert "8 messages kept by the checkpointer" in out
    assert "over budget 0" in out
    # the checkpoint holds plain values only: nothing blocked ("Blocked deserialization of cpmemory.types.Status")
    assert "Blocked deserialization" not in done.stderr and "cpmemory." not in done.stderr
    full, referenced = (int(part.split()[0]) for part in out.split("passage tokens: ")[1].split(", ")[:2])
    assert full > 0 and referenced > 0


def test_mem0_chat_example_on_locomo(tmp_path: Path) -> None:
    pytest.importorskip("mem0")
    pytest.importorskip("langchain")
    if not (DATA / "locomo" / "locomo10.json").exists():
        pytest.skip(f"LoCoMo data not found under {DATA}")
    args = ["--data-dir", str(DATA), "--sessions", "2", "--questions", "4", "--top-k", "6", "--json"]
    done = _run(tmp_path, "mem0_chat.py", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    totals = json.loads(done.stdout.strip().splitlines()[-1])
    assert totals["questions"] == 4 and totals["memories"] == 24
    assert totals["full"] + totals["referenced"] == totals["memories"]
    assert totals["referenced"] > 0 and totals["memory_tokens_referenced"] > 0
    assert totals["over_budget"] == 0 and totals["budget"] == 32000
    assert "pick: max_prompt_tokens as large as your model's context allows" in done.stdout
    compared = totals["compared"]
    assert len(compared) == 4
    for figures in compared.values():
        assert figures["questions"] == 4 and figures["over_budget"] == 0
        assert figures["full"] + figures["referenced"] == figures["memories"]
    windowed = _run(tmp_path, "mem0_chat.py", *args, "--history-turns", "1", "--no-compare")
    assert windowed.returncode == 0, windowed.stderr[-3000:]
    one_turn = json.loads(windowed.stdout.strip().splitlines()[-1])
    assert one_turn["history_turns"] == 1 and "compared" not in one_turn
    assert one_turn["prompt_cpmemory"] < totals["prompt_cpmemory"]  # one turn of history instead of up to three
