"""How blocks, references and the order annotation are written in the prompt.

The user message of a turn has four sections, each separated by a blank line, always in this order::

    [D3f9a0c1]                      <- a block shown in full: "[<label>]" on its own line, then its text
    <text of the block>

    [D77b01e2]                      <- a block shown in part (see cpmemory.core.dedup): only its new segments,
    <new segments>                     then one line naming the label(s) whose text holds the rest
    (Rest of [D77b01e2]: in [D3f9a0c1], shown earlier.)

    [D0c4e5aa] is shown earlier in this conversation.      <- one reference line per de-duplicated block

    Relevance order: D0c4e5aa D3f9a0c1, then the rest as shown      <- only when prompt order != relevance order

    Question: <the query>

The order annotation lists the labels in the caller's relevance order. When the prompt order and the relevance order
end with the same labels (the planner keeps every block nobody shares in relevance order, so they often do), the
annotation lists only the labels before that common tail and ends with ", then the rest as shown": the remaining
labels follow in the order they appear in the prompt. It is shortened only when that makes it shorter.

Labels come from the content hash (``Block.label``), so the same text gets the same label in every conversation and
cross-session prefixes stay byte-identical; caller ids never reach the prompt, so an id cannot inject text.
Every function here is pure and deterministic: the same inputs give the same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

REFERENCE_SUFFIX = " is shown earlier in this conversation."
# Compact on purpose: the annotation is unique to each request, so every token of it is prefilled (never cached).
# Labels are distinctive ("D" + hex digits), so they need no brackets here; the blocks keep "[label]" headers.
ORDER_PREFIX = "Relevance order: "
ORDER_REST = ", then the rest as shown"
QUESTION_PREFIX = "Question: "
SECTION_SEPARATOR = "\n\n"

LABEL_PATTERN = r"D[0-9a-f]{7,32}"
# A block header is a line holding only "[<label>]".
HEADER_RE = re.compile(r"^\[(" + LABEL_PATTERN + r")\]$", re.MULTILINE)
# "[<label>]" then a line break, anywhere (how a caller-given history is searched for blocks shown in it).
HEADER_ANYWHERE_RE = re.compile(r"\[(" + LABEL_PATTERN + r")\]\n")
# A line that starts with a label: a header, a reference, or a partial block's trailer (for appearance order).
LABELLED_LINE_RE = re.compile(r"^\(?(?:Rest of )?\[(" + LABEL_PATTERN + r")\]", re.MULTILINE)
# The order annotation is the line right before the question section (a look-alike line inside a block's text or
# inside the query is not followed by the question section, or comes after it).
ORDER_LINE_RE = re.compile(
    r"^" + re.escape(ORDER_PREFIX) + r"(.*)" + re.escape(SECTION_SEPARATOR + QUESTION_PREFIX), re.MULTILINE
)
_LABEL_IN_BRACKETS_RE = re.compile(r"\[(" + LABEL_PATTERN + r")\]")
_BARE_LABEL_RE = re.compile(r"\b(" + LABEL_PATTERN + r")\b")


def content_text(content: object) -> str:
    """The text of a chat message's content as a model reads it: the string, or its text parts joined by line
    breaks (other parts, e.g. images, have no text); "" for none. Pure."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        return ""
    return "\n".join(
        part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )


def block_header(label: str) -> str:
    """Return the header line that starts a block in the prompt."""
    return f"[{label}]"


def format_block(label: str, text: str) -> str:
    """Return a block shown in full: its header line, then its text unchanged."""
    return f"[{label}]\n{text}"


def format_partial(label: str, new_segments: Sequence[str], holder_labels: Sequence[str]) -> str:
    """Return a block shown in part: its new segments (one per line) and where the rest of its text is.

    Args:
        label: the block's own label.
        new_segments: the segments of the block not present earlier, in the block's order.
        holder_labels: labels of earlier blocks holding the other segments (may be empty: "shown earlier").
    """
    where = ", ".join(f"[{holder}]" for holder in holder_labels)
    trailer = (
        f"(Rest of [{label}]: in {where}, shown earlier.)"
        if where
        else f"(Rest of [{label}]: shown earlier.)"
    )
    body = "\n".join(new_segments)
    return f"[{label}]\n{body}\n{trailer}" if body else f"[{label}]\n{trailer}"


def format_reference(label: str) -> str:
    """Return the reference line that replaces a block whose full text is earlier in the prompt."""
    return f"[{label}]{REFERENCE_SUFFIX}"


def format_order(labels_in_relevance_order: Sequence[str], appearance: Sequence[str] | None = None) -> str:
    """Return the order annotation: the labels in the caller's relevance order.

    Args:
        labels_in_relevance_order: every label of the prompt, most relevant first.
        appearance: the same labels in the order they appear in the prompt; when given, a tail the two orders share
            is written as :data:`ORDER_REST` instead of its labels, if that is shorter.
    """
    relevance = list(labels_in_relevance_order)
    full = ORDER_PREFIX + " ".join(relevance)
    if appearance is None:
        return full
    shared = _common_tail(relevance, list(appearance))
    if shared == 0 or shared == len(relevance):
        return full
    short = ORDER_PREFIX + " ".join(relevance[: len(relevance) - shared]) + ORDER_REST
    return short if len(short) < len(full) else full


def _common_tail(a: Sequence[str], b: Sequence[str]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[len(a) - 1 - length] == b[len(b) - 1 - length]:
        length += 1
    return length


def format_question(query: str) -> str:
    """Return the question section."""
    return QUESTION_PREFIX + query


def build_user_message(
    shown: Sequence[str],
    references: Sequence[str],
    order_labels: Sequence[str] | None,
    query: str,
    appearance: Sequence[str] | None = None,
) -> str:
    """Assemble the user message from already formatted parts.

    Args:
        shown: formatted blocks (full or partial), in prompt order.
        references: labels of de-duplicated blocks, in prompt order.
        order_labels: labels in relevance order, or None when no order annotation is needed.
        query: the question.
        appearance: the labels in prompt order (shown, then references); lets the annotation name a shared tail
            as "the rest as shown" (see :func:`format_order`).

    Returns:
        The user message text. Pure; O(total length).
    """
    sections: list[str] = list(shown)
    if references:
        sections.append("\n".join(format_reference(label) for label in references))
    if order_labels:
        sections.append(format_order(order_labels, appearance))
    sections.append(format_question(query))
    return SECTION_SEPARATOR.join(sections)


def parse_order(text: str) -> list[str] | None:
    """Return the labels the order annotation of a user message lists, or None when there is none.

    For a shortened annotation (ending with :data:`ORDER_REST`) these are only the leading labels; use
    :func:`annotated_order` for the whole order.
    """
    match = ORDER_LINE_RE.search(text)
    if match is None:
        return None
    return _BARE_LABEL_RE.findall(match.group(1))


def annotated_order(text: str, labels: set[str] | frozenset[str]) -> list[str] | None:
    """Return the relevance order the annotation of a user message states, or None when there is none.

    A shortened annotation is completed with the other ``labels`` in the order they appear in the prompt.
    """
    match = ORDER_LINE_RE.search(text)
    if match is None:
        return None
    listed = _BARE_LABEL_RE.findall(match.group(1))
    if not match.group(1).endswith(ORDER_REST):
        return listed
    named = set(listed)
    return listed + [label for label in appearance_order(text, labels) if label not in named]


def appearance_order(text: str, labels: set[str] | frozenset[str]) -> list[str]:
    """Return the distinct ``labels`` in the order their first labelled line appears in ``text``.

    Only lines that start with a label (block headers, reference lines, partial trailers) count, and only labels in
    ``labels``, so a label quoted inside a block's text does not change the result.
    """
    seen: dict[str, None] = {}
    for label in LABELLED_LINE_RE.findall(text):
        if label in labels and label not in seen:
            seen[label] = None
    return list(seen)
