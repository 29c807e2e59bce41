"""The no-loss invariant, checked from the prompt alone: every caller block and message reaches the model.

``check_no_loss(blocks, messages)`` reads only what is sent to the engine (the chat messages) and what the caller
passed, never cpmemory's decisions, and it shares no code with the code it judges: it has its own reading of the
prompt format (labels, block headers, references, partial trailers, the order annotation), its own segmentation and
its own content hash. So it checks any producer of prompts, and a bug in the dedup, label or annotation code cannot
hide itself by being repeated here.

Blocks. Every caller item counts, whatever its id (two items with one id and two texts are two texts to deliver;
an item repeating an earlier item's text is delivered with it). A text ``T`` is delivered when its label ``L`` --
"D" + the first 7 to 32 hex digits of T's blake2b-128 content hash -- is named in brackets in the last message and

* **full**: ``"[L]\\n" + T`` occurs in the prompt at the start of a line, followed by a line break or the end; or
* **partial**: T has at least one segment and every segment of T is also a segment of the prompt. A segment is a
  non-blank piece of a line cut after ".", "!" or "?" followed by a space (the space is dropped);

and ``L`` names T only: every header line ``"[L]"`` in the prompt (the history sent and the last message) is
followed by T in full, or by segments of T one per line up to a ``"(Rest of [L]"`` trailer line. Otherwise a
reference to L would be ambiguous (two texts whose short labels collide). The longest label that passes is T's.

Order. The labels of the distinct texts, in the caller's relevance order, must equal the order annotation of the
last message when it has one -- a line ``"Relevance order: L1 L2 ..."`` (optionally ending with ``", then the rest
as shown"``: the other labels follow in prompt order) right before the ``"\\n\\nQuestion: "`` section, and not
inside the text of a block -- else the order in which the labels start lines of the last message (outside block
texts).

Messages (``caller_messages``): each caller message must reach the engine, in order, with every field unchanged
(role, content, tool calls, tool call ids, names, ...). Two rewritings are allowed: system messages may be merged
into a system message holding their text, and the caller's final user message may become the turn's user message
(holding its text, e.g. as the question). ``query``: the question text must be in the last message.

Cost: O(k * P) substring searches for k texts and a prompt of P characters, one segmentation of the prompt when a
text is not in full, one regex pass over the last message.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The prompt format, as the model reads it (deliberately restated here, not imported from the writer).
_LABEL = r"D[0-9a-f]{7,32}"
_BRACKETED = re.compile(r"\[(" + _LABEL + r")\]")
_LINE_LABEL = re.compile(r"(?:\(Rest of )?\[(" + _LABEL + r")\]")
_ORDER_PREFIX = "Relevance order: "
_ORDER_REST = ", then the rest as shown"
_QUESTION = "\n\nQuestion: "
_WHOLE_LABEL = re.compile(_LABEL)
_SENTENCE_CUT = re.compile(r"(?<=[.!?]) ")


@dataclass(frozen=True, slots=True)
class NoLossReport:
    """Result of :func:`check_no_loss`.

    Attributes:
        ok: True when nothing is lost and the order is recoverable.
        violations: one readable line per problem (empty when ok).
        full: number of distinct texts found in full.
        partial: number of distinct texts found only as segments.
    """

    ok: bool
    violations: list[str] = field(default_factory=list)
    full: int = 0
    partial: int = 0

    def __bool__(self) -> bool:
        return self.ok


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _segments(text: str) -> list[str]:
    out: list[str] = []
    for line in text.split("\n"):
        out.extend(piece for piece in _SENTENCE_CUT.split(line) if piece.strip())
    return out


def content_text(content: Any) -> str:
    """The text a model reads from a message's content: a string, text parts joined by line breaks, or ""."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "\n".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""


def _item(value: Any) -> tuple[str, Any]:
    """(id as shown in violations, text) of a caller item: a Block-like object, a mapping or an (id, text) pair."""
    if isinstance(value, Mapping):
        return repr(value.get("id")), value.get("text")
    if isinstance(value, tuple) and len(value) == 2:
        return repr(value[0]), value[1]
    return repr(getattr(value, "id", None)), getattr(value, "text", None)


class _Prompt:
    """The prompt as the model reads it; the segment set is computed only when some text is not in full."""

    __slots__ = ("_named", "_segments", "last", "text")

    def __init__(self, messages: Sequence[Mapping[str, Any]]) -> None:
        contents = [content_text(message.get("content")) for message in messages if isinstance(message, Mapping)]
        self.text = "\n\n".join(contents)
        self.last = contents[-1] if contents else ""
        self._segments: set[str] | None = None
        self._named: set[str] | None = None

    @property
    def named(self) -> set[str]:
        """Labels named in brackets in the last message."""
        if self._named is None:
            self._named = set(_BRACKETED.findall(self.last))
        return self._named

    @property
    def segments(self) -> set[str]:
        if self._segments is None:
            self._segments = set(_segments(self.text))
        return self._segments


def _full_at(text: str, rendering: str, start: int = 0) -> int:
    """Index of ``rendering`` in ``text`` at a line start, followed by a line break or the end; -1 when absent."""
    at = text.find(rendering, start)
    while at != -1:
        end = at + len(rendering)
        if (at == 0 or text[at - 1] == "\n") and (end == len(text) or text[end] == "\n"):
            return at
        at = text.find(rendering, at + 1)
    return -1


def _partial_end(text: str, body: int, label: str, pieces: set[str]) -> int:
    """End of a partial rendering whose lines start at ``body``: the end of its trailer line, or -1."""
    trailer = "(Rest of [" + label + "]"
    at = body
    while True:
        end = text.find("\n", at)
        line = text[at:] if end == -1 else text[at:end]
        if line.startswith(trailer):
            return len(text) if end == -1 else end
        if line not in pieces or end == -1:
            return -1
        at = end + 1


def _holds_only(text: str, label: str, block_text: str) -> bool:
    """True when every header line of ``label`` in ``text`` is followed by ``block_text`` or part of it."""
    header = "[" + label + "]"
    pieces: set[str] | None = None
    at = text.find(header)
    while at != -1:
        end = at + len(header)
        if (at == 0 or text[at - 1] == "\n") and (end == len(text) or text[end] == "\n"):
            body = end + 1
            full = text.startswith(block_text, body) and (
                body + len(block_text) >= len(text) or text[body + len(block_text)] == "\n"
            )
            if not full:
                pieces = set(_segments(block_text)) if pieces is None else pieces
                if _partial_end(text, body, label, pieces) == -1:
                    return False
        at = text.find(header, end)
    return True


def _candidates(digest: str, prompt: _Prompt) -> list[str]:
    named = [label for label in prompt.named if digest.startswith(label[1:])]
    return sorted(named, key=len, reverse=True)


def _check_text(ident: str, text: str, prompt: _Prompt) -> tuple[str, str | None, str | None]:
    """(the text's label, "full" / "partial" / None, a violation or None)."""
    digest = _digest(text)
    labels = _candidates(digest, prompt)
    if not labels:
        return "D" + digest[:7], None, f"block {ident} (D{digest[:7]}) is not named in the last message"
    problem = ""
    for label in labels:
        if not _holds_only(prompt.text, label, text):
            problem = problem or f"block {ident} ({label}): the label also names another text in the prompt"
            continue
        if _full_at(prompt.text, "[" + label + "]\n" + text) != -1:
            return label, "full", None
        parts = _segments(text)
        missing = [part for part in parts if part not in prompt.segments]
        if parts and not missing:
            return label, "partial", None
        sample = (missing or [text])[0][:60]
        problem = problem or f"block {ident} ({label}) is lost: {len(missing) or 1} segment(s) absent, e.g. {sample!r}"
    return labels[0], None, problem


def check_no_loss(
    blocks: Iterable[Any],
    messages: Sequence[Mapping[str, Any]],
    *,
    check_order: bool = True,
    caller_messages: Sequence[Mapping[str, Any]] | None = None,
    query: str | None = None,
) -> NoLossReport:
    """Check that every caller block and message reaches the model and the relevance order is recoverable.

    Args:
        blocks: what the caller passed, best-ranked first (Block, {"id", "text"} or (id, text)); every item counts.
        messages: the chat messages sent to the engine.
        check_order: also check the order annotation (or the prompt order when there is none).
        caller_messages: the caller's own messages (its history, or a proxy request's messages), each of which
            must be delivered with every field (module docstring).
        query: the question, which must be in the last message.

    Returns:
        A NoLossReport. Pure; never raises on a malformed prompt or item (that is a violation).
    """
    prompt = _Prompt(messages)
    violations: list[str] = []
    counts = {"full": 0, "partial": 0}
    labels: dict[str, str] = {}  # text -> label, in relevance order of first occurrence
    for rank, value in enumerate(blocks):
        ident, text = _item(value)
        if not isinstance(text, str):
            violations.append(f"block #{rank} {ident} has no text")
            continue
        if text in labels:
            continue
        label, how, problem = _check_text(ident, text, prompt)
        labels[text] = label
        if problem:
            violations.append(problem)
        elif how:
            counts[how] += 1
    if check_order and labels:
        problem = _check_order(list(dict.fromkeys(labels.values())), list(labels.items()), prompt.last)
        if problem:
            violations.append(problem)
    if caller_messages is not None:
        violations.extend(check_messages(caller_messages, messages))
    if query is not None and query not in prompt.last:
        violations.append(f"the question {query[:60]!r} is not in the last message")
    return NoLossReport(not violations, violations, counts["full"], counts["partial"])


def _body_spans(last: str, shown: Sequence[tuple[str, str]]) -> list[tuple[int, int]]:
    """Where block texts lie in the last message (after their header line), so look-alike lines inside are skipped."""
    spans: list[tuple[int, int]] = []
    for text, label in shown:
        header = "[" + label + "]\n"
        at = _full_at(last, header + text)
        while at != -1:
            spans.append((at + len(header), at + len(header) + len(text)))
            at = _full_at(last, header + text, at + 1)
        at = last.find(header)
        pieces = set(_segments(text))
        while at != -1:
            end = _partial_end(last, at + len(header), label, pieces)
            if (at == 0 or last[at - 1] == "\n") and end != -1:
                spans.append((at + len(header), end))
            at = last.find(header, at + 1)
    return spans


def _line_starts(last: str, spans: Sequence[tuple[int, int]]) -> list[int]:
    """Starts of the lines of ``last`` that are not inside a block text (one sweep over the sorted spans)."""
    ordered = sorted(spans)
    out: list[int] = []
    k, covered = 0, -1
    start = 0
    while start != -1 and start <= len(last):
        while k < len(ordered) and ordered[k][0] <= start:
            covered = max(covered, ordered[k][1])
            k += 1
        if start >= covered:
            out.append(start)
        found = last.find("\n", start)
        start = -1 if found == -1 else found + 1
    return out


def _read_order(last: str, starts: Sequence[int], expected: set[str]) -> tuple[list[str] | None, list[str]]:
    """(the annotation's labels and whether it ends with the rest marker, or None; labels in appearance order)."""
    appearance: dict[str, None] = {}
    annotation: list[str] | None = None
    for start in starts:
        end = last.find("\n", start)
        line = last[start:] if end == -1 else last[start:end]
        if annotation is None and line.startswith(_ORDER_PREFIX) and last.startswith(_QUESTION, start + len(line)):
            annotation = _annotation_labels(line[len(_ORDER_PREFIX) :])
        match = _LINE_LABEL.match(line)
        if match and match.group(1) in expected:
            appearance.setdefault(match.group(1), None)
    return annotation, list(appearance)


def _annotation_labels(body: str) -> list[str]:
    rest = body.endswith(_ORDER_REST)
    tokens = (body[: -len(_ORDER_REST)] if rest else body).split(" ")
    labels = [token for token in tokens if _WHOLE_LABEL.fullmatch(token)]
    if len(labels) != len(tokens):
        return ["<malformed: " + body[:60] + ">"]
    return labels + ["..."] if rest else labels


def _check_order(expected: list[str], shown: Sequence[tuple[str, str]], last: str) -> str | None:
    starts = _line_starts(last, _body_spans(last, shown))
    annotation, appearance = _read_order(last, starts, set(expected))
    if annotation is not None:
        if annotation and annotation[-1] == "...":
            listed = annotation[:-1]
            annotation = listed + [label for label in appearance if label not in set(listed)]
        if annotation == expected:
            return None
        return f"order annotation {annotation} does not match the relevance order {expected}"
    if appearance == expected:
        return None
    return f"prompt order {appearance} differs from the relevance order {expected} and there is no order annotation"


def _delivers(sent: Mapping[str, Any], caller: Mapping[str, Any], merged: bool) -> str | None:
    """"exact" / "merged" when ``sent`` delivers ``caller`` (module docstring), else None."""
    if not isinstance(sent, Mapping) or sent.get("role") != caller.get("role"):
        return None
    if any(key != "content" and sent.get(key) != value for key, value in caller.items()):
        return None
    if sent.get("content") == caller.get("content"):
        return "exact"
    text = content_text(caller.get("content"))
    parts = caller.get("content")
    only_text = isinstance(parts, str) or (
        isinstance(parts, (list, tuple))
        and all(isinstance(part, Mapping) and part.get("type") == "text" for part in parts)
    )
    if merged and only_text and text and all(
        piece in content_text(sent.get("content")) for piece in text.split("\n")
    ):
        return "merged"
    return None


def check_messages(caller: Sequence[Mapping[str, Any]], sent: Sequence[Mapping[str, Any]]) -> list[str]:
    """Violations for caller messages not delivered, in order, with every field (see the module docstring)."""
    violations: list[str] = []
    at = 0
    last_user = max((i for i, m in enumerate(caller) if isinstance(m, Mapping) and m.get("role") == "user"),
                    default=-1)
    for i, message in enumerate(caller):
        if not isinstance(message, Mapping):
            violations.append(f"caller message #{i} is not a mapping")
            continue
        merged = message.get("role") == "system" or (i == last_user and i == len(caller) - 1)
        for j in range(at, len(sent)):
            how = _delivers(sent[j], message, merged)
            if how:
                at = j + 1 if how == "exact" else j
                break
        else:
            role = message.get("role")
            fields = sorted(str(key) for key in message)
            violations.append(f"caller message #{i} ({role!r}, fields {fields}) is not delivered unchanged")
    return violations
