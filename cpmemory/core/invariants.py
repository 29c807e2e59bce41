"""The no-loss invariant: every block a caller passed reaches the model, and its relevance order is recoverable.

``check_no_loss(blocks, messages)`` looks only at the final prompt (the chat messages sent to the engine), never at
cpmemory's internal decisions, so it checks any producer of prompts. A block passes when one of these holds:

* **full**: ``"[<label>]\\n<text>"`` occurs in the prompt (in this turn's message or in the history it sends), and its
  label is named in the last message (shown there, or referenced there);
* **partial**: every segment of its text (``cpmemory.core.dedup.split_segments``: lines, then sentences) is also a
  whole segment of the prompt (not merely a substring: "b" inside a label does not count), and its label is named in
  the last message.

A block's label is "D" + the first 7 or more hex digits of its content hash: the longest such label named in the last
message that passes is the block's label. A label must name one text only: every block header "[<label>]" in the
prompt must hold the block's text (in full or in part, ``cpmemory.core.dedup.label_holds_only``), otherwise a
reference to it would be ambiguous (two texts whose short labels collide).

Order: the labels of the blocks, distinct, in the caller's relevance order, must equal the order annotation of the
last message when it has one, else the order in which the labels first appear at the start of a line of that message.

Cost: O(k * P) substring searches for k blocks and a prompt of P characters (``str.find`` is memchr-fast), one
segmentation of the prompt when some block is not in full, plus one regex pass over the last message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cpmemory.core import annotations
from cpmemory.core.blocks import LABEL_HEX_DIGITS, Block, BlockLike, normalize_blocks
from cpmemory.core.dedup import label_holds_only, split_segments


@dataclass(frozen=True, slots=True)
class NoLossReport:
    """Result of :func:`check_no_loss`.

    Attributes:
        ok: True when nothing is lost and the order is recoverable.
        violations: one readable line per problem (empty when ok).
        full: number of blocks found in full.
        partial: number of blocks found only as segments.
    """

    ok: bool
    violations: list[str] = field(default_factory=list)
    full: int = 0
    partial: int = 0

    def __bool__(self) -> bool:
        return self.ok


class _Prompt:
    """The prompt text, with its segment set computed only when a block is not found in full."""

    __slots__ = ("_named", "_segments", "last", "text")

    def __init__(self, messages: Sequence[Mapping[str, str]]) -> None:
        contents = [str(message.get("content", "")) for message in messages]
        self.text = "\n\n".join(contents)
        self.last = contents[-1] if contents else ""
        self._segments: set[str] | None = None
        self._named: dict[str, set[str]] | None = None

    def named(self, short: str) -> set[str]:
        """Labels in brackets in the last message that start with ``short`` (one regex pass, on first use)."""
        if self._named is None:
            self._named = {}
            for label in _BRACKETED_LABEL_RE.findall(self.last):
                self._named.setdefault(label[: 1 + LABEL_HEX_DIGITS], set()).add(label)
        return self._named.get(short, set())

    @property
    def segments(self) -> set[str]:
        if self._segments is None:
            self._segments = set(split_segments(self.text))
        return self._segments


_BRACKETED_LABEL_RE = re.compile(r"\[(" + annotations.LABEL_PATTERN + r")\]")


def _labels_named(block: Block, prompt: _Prompt) -> list[str]:
    """Labels of the block's content hash named in the last message, longest first (the short one when none)."""
    digest = block.content_hash
    short = "D" + digest[:LABEL_HEX_DIGITS]
    named = [label for label in prompt.named(short) if digest.startswith(label[1:])]
    return sorted(named, key=len, reverse=True) or [short]


def _check_block(block: Block, prompt: _Prompt) -> tuple[str, str | None, str | None]:
    """Return (the block's label, how it is present: "full" / "partial" / None, a violation or None)."""
    problem: str | None = None
    for label in _labels_named(block, prompt):
        how, issue = _check_label(block, label, prompt)
        if issue is None:
            return label, how, None
        problem = problem or issue
    return block.label, None, problem


def _check_label(block: Block, label: str, prompt: _Prompt) -> tuple[str | None, str | None]:
    if f"[{label}]" not in prompt.last:
        return None, f"block {block.id!r} ({label}) is not named in the last message"
    if not label_holds_only(prompt.text, label, block.text):
        return None, f"block {block.id!r} ({label}): the label also names another text in the prompt"
    if annotations.format_block(label, block.text) in prompt.text:
        return "full", None
    missing = [segment for segment in split_segments(block.text) if segment not in prompt.segments]
    if not missing:
        return "partial", None
    return (
        None,
        f"block {block.id!r} ({label}) is lost: {len(missing)} segment(s) absent, e.g. {missing[0][:60]!r}",
    )


def check_no_loss(
    blocks: Iterable[BlockLike], messages: Sequence[Mapping[str, str]], *, check_order: bool = True
) -> NoLossReport:
    """Check that every block is in the prompt (full or partial) and that the relevance order is recoverable.

    Args:
        blocks: the blocks the caller passed, best-ranked first (a repeated id keeps its first occurrence).
        messages: the chat messages sent to the engine.
        check_order: also check the order annotation (or the prompt order when there is none).

    Returns:
        A NoLossReport. Pure; never raises on a malformed prompt (that is a violation).
    """
    normalized = normalize_blocks(blocks)
    prompt = _Prompt(messages)
    violations: list[str] = []
    counts = {"full": 0, "partial": 0}
    labels: list[str] = []
    for block in normalized:
        label, how, problem = _check_block(block, prompt)
        labels.append(label)
        if problem:
            violations.append(problem)
        elif how:
            counts[how] += 1
    if check_order and normalized:
        problem = _check_order(labels, prompt.last)
        if problem:
            violations.append(problem)
    return NoLossReport(not violations, violations, counts["full"], counts["partial"])


def _check_order(labels: Sequence[str], last: str) -> str | None:
    expected = list(dict.fromkeys(labels))
    annotated = annotations.annotated_order(last, frozenset(expected))
    if annotated is not None:
        if annotated == expected:
            return None
        return f"order annotation {annotated} does not match the relevance order {expected}"
    found = annotations.appearance_order(last, frozenset(expected))
    if found == expected:
        return None
    return (
        f"prompt order {found} differs from the relevance order {expected} and there is no order annotation"
    )
