"""The user docs: a short README, relative links that resolve, no dated run diaries.

The pages are README.md, ARCHITECTURE.md, SECURITY.md and docs/**/*.md (docs/README.md says what goes where). A link
is relative when it names no scheme; it must name a file or folder of the repository, and an anchor on a Markdown
page must name one of that page's headings (GitHub's slugs). Measurement diaries ("Measured 2026-...", "the
twenty-fourth machine") belong to the git history, not to the pages a user reads.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README_MAX_LINES = 200
PAGES = sorted(
    [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "SECURITY.md", *(ROOT / "docs").rglob("*.md")]
)

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
ORDINAL = (
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    r"fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\w+|thirtieth|thirty-\w+"
)
DIARY = [
    re.compile(r"machines?\)", re.IGNORECASE),
    re.compile(rf"\b(?:{ORDINAL})\s+machines?\b", re.IGNORECASE),
    re.compile(r"\bMeasured\s+20\d\d-\d\d", re.IGNORECASE),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),
]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a Markdown page offers (repeated headings numbered as GitHub numbers them)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of one page that name no file, or an anchor its target lacks (located from ``root``)."""
    broken = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, https:, mailto:
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no such heading)")
    return broken


def test_the_pages_are_found() -> None:
    names = {page.relative_to(ROOT).as_posix() for page in PAGES}
    assert {"README.md", "ARCHITECTURE.md", "docs/README.md", "docs/decisions.md"} <= names


def test_the_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_no_run_diary_in_the_user_docs(page: Path) -> None:
    hits = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        if any(pattern.search(line) for pattern in DIARY)
    ]
    assert hits == []


def test_the_checks_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[gone](missing.md) [here](#title) [nowhere](#other)\n```\n[code](x.md)\n```\n")
    found = broken_links(page, root=tmp_path)
    assert found == ["page.md:3: missing.md (no such file)", "page.md:3: #other (no such heading)"]
    assert any(pattern.search("on the twenty-fourth machine") for pattern in DIARY)
    assert any(pattern.search("(AMD EPYC, fast machine)") for pattern in DIARY)
    assert not any(pattern.search("a machine with two cores") for pattern in DIARY)


def test_slugs_follow_github() -> None:
    assert slug("Online: what users get") == "online-what-users-get"
    assert slug("`cpmemory bench serve`: the proxy end to end") == "cpmemory-bench-serve-the-proxy-end-to-end"
    assert slug("Results: one current page per benchmark") == "results-one-current-page-per-benchmark"
