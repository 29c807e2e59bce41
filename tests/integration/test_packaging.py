"""The library works with its three dependencies alone: no extra (CLI, Redis, HTTP, server, frameworks) is imported
by ``import cpmemory`` or by a full turn through the facade."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ["typer", "rich", "psutil", "httpx", "redis", "zmq", "msgpack", "fastapi", "uvicorn", "prometheus_client",
          "mem0", "langchain_core", "langgraph", "matplotlib", "bm25s", "tqdm"]

SCRIPT = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS!r}:
            raise ImportError("extra not installed: " + name)
sys.meta_path.insert(0, Block())
import cpmemory
from cpmemory import CpMemory
mem = CpMemory()
turn = mem.prepare("c", "Which fact?", [{{"id": "a", "text": "The harbor opens at nine."}}])
mem.commit(turn, "Nine.")
again = mem.prepare("c", "And?", [{{"id": "a", "text": "The harbor opens at nine."}}])
assert [d.status for d in again.decisions] == ["referenced"], again.decisions
print("ok", cpmemory.__version__)
"""


def test_the_library_needs_no_extra() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")


def test_the_console_script_names_the_cli_extra_when_it_is_missing() -> None:
    script = ("import importlib.util, sys\nreal = importlib.util.find_spec\n"
              "importlib.util.find_spec = lambda name, *a: None if name in ('typer', 'rich') else real(name, *a)\n"
              "from cpmemory._entry import main\nmain()\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pip install -e '.[cli]'" in done.stderr
