"""No machine ordinals or dated results in the package's comments, docstrings and messages.

Results go stale and belong in docs/results/ and docs/decisions.md (the git history keeps the runs); code keeps
the reason in words. Two patterns are precise enough to check mechanically:

* a machine ordinal: ``(the twenty-fourth machine)``, ``on the 13th machine``, ``the n-th machine``, or a compound
  ordinal on its own (``on the twenty-fourth 1.58x``), in any comment or string literal;
* an ISO date (``2026-12-03``) in a comment or docstring (string values such as an API version header may be dates,
  and a comment naming such a version says "version").
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "cpmemory", *sorted((ROOT / "integrations").glob("*/*_cpmemory")))

_SIMPLE = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
           "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth")
_COMPOUND = r"(?:twenty|thirty|forty|fifty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
ORDINAL = re.compile(
    rf"\b(?:\d+(?:st|nd|rd|th)|n-th|{_SIMPLE}|{_COMPOUND})[\s-]+(?:reference\s+|bench\s+)?machines?\b"
    rf"|\b{_COMPOUND}\b"
    r"|\b(?:thir|four|fif|six|seven|eigh|nine)teenth\b",
    re.IGNORECASE,
)
ISO_DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")


def offences(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` for each machine ordinal in a comment or string and each ISO date in a comment or docstring.

    A docstring here is any string standing alone as a statement (module, class, function and attribute docstrings).
    """
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstring_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        for offset, line in enumerate(token.string.splitlines()):
            number = token.start[0] + offset
            dated = token.type == tokenize.COMMENT or number in docstring_lines
            if ORDINAL.search(line) or (dated and ISO_DATE.search(line) and "version" not in line.lower()):
                yield number, line.strip()


def package_files() -> list[Path]:
    return sorted(path for source in SOURCES for path in source.rglob("*.py"))


def test_package_has_no_machine_ordinals_or_dates() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in package_files()
        for line, text in offences(path.read_text(encoding="utf-8"))
    ]
    assert not found, "results belong in docs/results/ or docs/decisions.md:\n" + "\n".join(found)


def test_the_scan_covers_the_package() -> None:
    files = {path.relative_to(ROOT).as_posix() for path in package_files()}
    assert "cpmemory/facade.py" in files
    assert any(name.startswith("integrations/") for name in files)


@pytest.mark.parametrize("source", [
    '"""Faster (measured 2.3x on the twenty-fourth machine)."""\n',
    "# 1.58x on the twenty-fourth, 1.64x on the fourteenth\nX = 1\n",
    "X = 1  # as measured on the 13th machine\n",
    "def f() -> None:\n    \"\"\"Slower on the n-th machine.\"\"\"\n",
    "log = 'hold cost 286 ms (fourth bench machine)'\n",
    '"""Measured 2026-12-03 on MT-RAG."""\n',
    "X = 2  # since 2026-12-03\n",
    'X = 3\n"""The attribute\'s doc, run 2025-01-31."""\n',
])
def test_flags_ordinals_and_dates(source: str) -> None:
    assert list(offences(source))


@pytest.mark.parametrize("source", [
    '"""Terminate the server (SIGTERM, then SIGKILL after 5 s), even on a loaded machine)."""\n',
    "# Smith's rule for the sum of completion times on one machine\nX = 1\n",
    'ANTHROPIC_VERSION = "2023-06-01"\n',
    "# the anthropic-version header, 2023-06-01\nX = 1\n",
    '"""vLLM\'s KV blocks are 16 tokens; the first block of the prompt."""\n',
    "X = '2026-12-03'  # a date value, not a result\n",
])
def test_leaves_legitimate_text(source: str) -> None:
    assert not list(offences(source))
