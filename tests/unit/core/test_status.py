"""One Status enum: its members are their wire strings, and no other module spells a status as a string literal."""
from __future__ import annotations

import ast
import json
from pathlib import Path

from cpmemory import BlockStatus, Status
from cpmemory.types import BLOCK_STATUSES, FULL_TEXT_STATUSES

ROOT = Path(__file__).resolve().parents[3]
# The independent no-loss checker counts "full" / "partial" prompt blocks of its own (it must not share dedup code).
OWN_SPELLING = {ROOT / "cpmemory" / "types.py", ROOT / "cpmemory" / "core" / "invariants.py"}
DISTINCT = {"referenced", "resent", "partial", "changed", "passthrough"}  # statuses that are not everyday words


def test_members_are_their_wire_strings() -> None:
    for status in Status:
        assert status == status.value and str(status) == status.value and f"{status}" == status.value
        assert json.dumps({"status": status}) == json.dumps({"status": status.value})
        assert hash(status) == hash(status.value) and Status(status.value) is status
    assert [str(s) for s in BLOCK_STATUSES] == ["new", "referenced", "changed", "partial", "resent"]
    assert sorted(FULL_TEXT_STATUSES) == ["changed", "new", "resent"]
    assert set(BlockStatus.__args__) == set(BLOCK_STATUSES)  # type: ignore[attr-defined]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_no_module_spells_a_status_literal() -> None:
    files = [*ROOT.glob("cpmemory/**/*.py"), *ROOT.glob("integrations/*/*_cpmemory/**/*.py")]
    assert len(files) > 50
    found = []
    for path in files:
        if path in OWN_SPELLING:
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in DISTINCT and id(node) not in skip]
    assert found == [], "use cpmemory.types.Status: " + ", ".join(found)
