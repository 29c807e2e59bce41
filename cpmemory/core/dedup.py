"""De-duplication across the turns of one conversation (the paper's Algorithm 3), keyed on content.

For each block of a request, in relevance order, the first rule that applies decides (``decide``):

1. **referenced** (in-request duplicate): an earlier block of this request has the same content hash; the block is
   covered by that one (same label), nothing more is written.
2. **changed**: the conversation last committed this block id with a different content hash. Sent in full and never
   de-duplicated against its old version.
3. **referenced**: the block's full text, under its label (``"[<label>]\\n<text>"``), is present in the history this
   very request sends. The block is replaced by a one-line reference. With the stored transcript this is exactly
   "the content hash was committed earlier in this conversation" (a committed turn's user message holds every block it
   showed in full); with a caller-given history the text is looked up in that history.
4. **resent**: the content was committed earlier but its text is not in the history sent now (truncated or replaced
   history). Sent in full.
5. **partial**: the block's text is *mostly* present verbatim in the sent history. The text is cut into segments
   (``split_segments``: lines, then sentences ending in ``.``, ``!`` or ``?`` followed by a space). A segment counts as
   present when it is at least ``MIN_SEGMENT_CHARS`` (24) characters long and appears as a segment of a block shown
   earlier in the history (a line under a block header of a user message).
   If the present segments hold at least ``threshold`` (default 0.5, i.e. 50%) of the block's segment characters, only
   the other segments are sent, with a line naming the label(s) whose text holds the rest.
6. **new**: anything else, sent in full.

``decide``, ``partial_overlap`` and ``split_segments`` are pure (no IO, no mutation of inputs); only
``SegmentIndex.extend`` mutates its own index. ``decide`` is O(k) for k blocks when no history segments are given;
with segments it adds O(len(text)) per candidate block.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cpmemory.core import annotations
from cpmemory.core.blocks import LABEL_HEX_DIGITS, Block, label_for_hash
from cpmemory.types import FULL_TEXT_STATUSES, BlockStatus, Status

DEFAULT_PARTIAL_THRESHOLD = 0.5
MIN_SEGMENT_CHARS = 24

_SENTENCE_MARKS = (". ", "! ", "? ")
_STOP_LINE_PREFIXES = (annotations.ORDER_PREFIX, annotations.QUESTION_PREFIX, "(Rest of [")


def _split_line(line: str) -> list[str]:
    pieces = [line]
    for mark in _SENTENCE_MARKS:
        if mark in line:
            cut: list[str] = []
            for piece in pieces:
                parts = piece.split(mark)
                cut.extend(part + mark[0] for part in parts[:-1])
                cut.append(parts[-1])
            pieces = cut
    return pieces


def split_segments(text: str) -> list[str]:
    """Cut ``text`` into its non-blank segments: lines, then sentences (cut after ". ", "! " and "? ").

    Every segment is a verbatim substring of ``text``. Pure; O(len(text)) with str methods only (no regex: this
    runs for every new block of every request).
    """
    out: list[str] = []
    for line in text.split("\n"):
        if line and not line.isspace():
            out.extend(piece for piece in _split_line(line) if piece and not piece.isspace())
    return out


@dataclass(frozen=True, slots=True)
class DedupDecision:
    """What to do with one block.

    Attributes:
        status: one of "new", "referenced", "changed", "partial", "resent".
        duplicate_of: index (in the request) of the earlier block with the same content, for in-request duplicates.
        new_segments: for "partial": the segments to send, in the block's order.
        holder_labels: for "partial": labels of earlier blocks holding the other segments.
        saved_chars: characters of the block's text not sent in full because of this decision.
        label: for "referenced" (not in-request duplicates): the label the history shows the block's text under.
    """

    status: BlockStatus
    duplicate_of: int | None = None
    new_segments: tuple[str, ...] = ()
    holder_labels: tuple[str, ...] = ()
    saved_chars: int = 0
    label: str = ""

    @property
    def in_full(self) -> bool:
        """True when the block's full text is written in this prompt under its header."""
        return self.status in FULL_TEXT_STATUSES


_NEW = DedupDecision(Status.NEW)
_CHANGED = DedupDecision(Status.CHANGED)
_RESENT = DedupDecision(Status.RESENT)


COLLISION_LABEL_DIGITS = 12
FULL_LABEL_DIGITS = 32


def label_candidates(
    digest: str, digits: int = LABEL_HEX_DIGITS, longer: int = COLLISION_LABEL_DIGITS
) -> list[str]:
    """The labels a block may get, shortest first: ``digits`` hex digits, then ``longer``, then the whole hash."""
    lengths = dict.fromkeys(d for d in (digits, longer, FULL_LABEL_DIGITS) if d >= digits)
    return [label_for_hash(digest, d) for d in lengths]


def label_holds_only(prompt: str, label: str, text: str) -> bool:
    """True when every block header of ``label`` in ``prompt`` starts ``text`` or a partial rendering of it.

    A header is "[<label>]" on its own line. It holds ``text`` when the full text follows (then the end of the prompt
    or a line break), or when only segments of ``text`` follow, one per line, up to the "(Rest of [<label>]" trailer
    (cpmemory.core.annotations.format_partial). False means the label also names another text: a reference to it
    would be ambiguous. Pure; O(len(prompt)).
    """
    header = annotations.block_header(label) + "\n"
    positions: list[int] = []
    at = prompt.find(header)
    while at != -1:
        positions.append(at)
        at = prompt.find(header, at + len(header))
    return _holds_only_at(prompt, label, text, positions)


def _holds_only_at(prompt: str, label: str, text: str, positions: Iterable[int]) -> bool:
    """:func:`label_holds_only` given the positions of every ``"[<label>]\n"`` in ``prompt``."""
    header_length = len(annotations.block_header(label)) + 1
    trailer = f"(Rest of [{label}]"
    segments: set[str] | None = None
    for at in positions:
        body = at + header_length
        if at == 0 or prompt[at - 1] == "\n":
            after = body + len(text)
            holds_full = prompt.startswith(text, body) and (after == len(prompt) or prompt[after] == "\n")
            if not holds_full and not prompt.startswith(trailer, body):
                end = prompt.find("\n" + trailer, body)
                if segments is None:
                    segments = set(split_segments(text))
                if end == -1 or not set(prompt[body:end].split("\n")) <= segments:
                    return False
    return True


class HistoryView(Protocol):
    """What dedup needs to know about the history a request sends."""

    def present_label(self, block: Block, digest: str) -> str | None:
        """Return the label the history shows the block's full text under, or None when it does not."""
        ...


def _seen_label(seen: frozenset[str] | Mapping[str, object], digest: str) -> str | None:
    if digest not in seen:
        return None
    entry = seen[digest] if isinstance(seen, Mapping) else None
    return getattr(entry, "label", None) or label_for_hash(digest)


@dataclass(frozen=True, slots=True)
class CommittedHistory:
    """The stored transcript: a content hash committed earlier is, by construction, present in it in full.

    ``seen_hashes`` maps a committed hash to its SeenBlock (whose ``label`` is the one it was shown under); a plain
    set of hashes means the default labels.
    """

    seen_hashes: frozenset[str] | Mapping[str, object]

    def present_label(self, block: Block, digest: str) -> str | None:
        """O(1): the label the hash was committed under, None when it was not."""
        return _seen_label(self.seen_hashes, digest)

    def has_full(self, block: Block, digest: str) -> bool:
        """O(1): membership of the hash in what the conversation committed."""
        return digest in self.seen_hashes


@dataclass(frozen=True, slots=True)
class GivenHistory:
    """A caller-given history, looked up verbatim (a block is present when "[<label>]\\n<text>" occurs in it under a
    label that names no other text; the label may be a longer one given to avoid a collision).

    Every ``"[<label>]\\n"`` of the text is indexed once (one regex pass, or ``headers`` given: label -> the
    positions of its ``"["``, as :func:`header_positions` finds them): a block is then looked up at the positions
    of its own labels, not by searching the whole history once per block.
    """

    text: str
    label_digits: int = LABEL_HEX_DIGITS
    collision_label_digits: int = COLLISION_LABEL_DIGITS
    headers: Mapping[str, Sequence[int]] | None = field(default=None, repr=False, compare=False)
    _headers: Mapping[str, Sequence[int]] = field(init=False, repr=False, compare=False)
    _short: frozenset[str] = field(init=False, repr=False, compare=False)  # the headers' shortest-label prefixes

    def __post_init__(self) -> None:
        headers = self.headers if self.headers is not None else header_positions(self.text)
        object.__setattr__(self, "_headers", headers)
        object.__setattr__(self, "_short", frozenset(label[: 1 + self.label_digits] for label in headers))

    @classmethod
    def from_messages(
        cls,
        messages: Iterable[Mapping[str, str]],
        label_digits: int = LABEL_HEX_DIGITS,
        collision_label_digits: int = COLLISION_LABEL_DIGITS,
    ) -> GivenHistory:
        """Join the contents of ``messages`` (O(total length)) with the label lengths (see the fields)."""
        return cls("\n\n".join(message["content"] for message in messages), label_digits, collision_label_digits)

    def present_label(self, block: Block, digest: str) -> str | None:
        """O(1) when no label of the block heads a text in the history; else O(len(text)) per header of it."""
        headers, text = self._headers, self.text
        if label_for_hash(digest, self.label_digits) not in self._short:  # every candidate starts with it
            return None
        for label in label_candidates(digest, self.label_digits, self.collision_label_digits):
            positions = headers.get(label)
            if not positions:
                continue
            body = len(label) + 3  # "[" label "]\n"
            if any(text.startswith(block.text, at + body) for at in positions) and _holds_only_at(
                text, label, block.text, positions
            ):
                return label
        return None

    def has_full(self, block: Block, digest: str) -> bool:
        """True when :meth:`present_label` finds the block."""
        return self.present_label(block, digest) is not None


def header_positions(text: str, offset: int = 0) -> dict[str, list[int]]:
    """Label -> the positions (plus ``offset``) of every ``"[<label>]\\n"`` in ``text``. Pure; O(len(text))."""
    headers: dict[str, list[int]] = {}
    for found in annotations.HEADER_ANYWHERE_RE.finditer(text):
        headers.setdefault(found.group(1), []).append(offset + found.start())
    return headers


class SegmentIndex:
    """Segments of the blocks shown earlier in a history, each with the label of the block holding it.

    ``extend`` indexes more messages (O(their length)); ``holder`` is O(1). Each segment remembers the position of
    the first message holding it, and a view made with ``limited_to(n)`` only sees segments of the first ``n``
    messages: a cached index that grew for a longer history stays correct for a request sending a shorter one.
    """

    __slots__ = ("_holders", "_labels", "_limit", "_messages", "_repeated")

    def __init__(self) -> None:
        self._holders: dict[str, tuple[str, int]] = {}
        self._labels: dict[str, int] = {}
        self._repeated: dict[str, int] = {}  # label -> message holding its second header
        self._messages = 0
        self._limit: int | None = None

    @classmethod
    def from_messages(cls, messages: Iterable[Mapping[str, str]]) -> SegmentIndex:
        """Index the segments under each block header of every user message in ``messages``."""
        index = cls()
        index.extend(messages)
        return index

    @property
    def messages(self) -> int:
        """How many messages were indexed."""
        return self._messages

    def extend(self, messages: Iterable[Mapping[str, str]]) -> None:
        """Index further messages (mutates; the caller serialises concurrent extends)."""
        for message in messages:
            if message.get("role") == "user":
                _index_message(
                    message.get("content", ""), self._holders, (self._labels, self._repeated), self._messages
                )
            self._messages += 1

    def limited_to(self, messages: int) -> SegmentIndex:
        """A read-only view that only sees segments of the first ``messages`` messages (O(1), shares the dict)."""
        view = SegmentIndex.__new__(SegmentIndex)
        view._holders, view._labels, view._repeated = self._holders, self._labels, self._repeated
        view._messages, view._limit = min(messages, self._messages), messages
        return view

    def has_header(self, label: str) -> bool:
        """True when a user message of the history has a block header with ``label``. O(1)."""
        found = self._labels.get(label)
        return found is not None and (self._limit is None or found < self._limit)

    def header_repeated(self, label: str) -> bool:
        """True when the history has two or more block headers with ``label`` (maybe two texts). O(1)."""
        found = self._repeated.get(label)
        return found is not None and (self._limit is None or found < self._limit)

    def holder(self, segment: str) -> str | None:
        """Return the label of the earlier block holding ``segment``, or None."""
        found = self._holders.get(segment)
        if found is None or (self._limit is not None and found[1] >= self._limit):
            return None
        return found[0]

    def __len__(self) -> int:
        return len(self._holders)


def _index_message(
    content: str,
    holders: dict[str, tuple[str, int]],
    headers: tuple[dict[str, int], dict[str, int]],
    position: int,
) -> None:
    labels, repeated = headers
    current: str | None = None
    for line in content.split("\n"):
        if line.startswith("[D") and line.endswith("]") and annotations.HEADER_RE.fullmatch(line):
            current = line[1:-1]
            if current in labels:
                repeated.setdefault(current, position)
            else:
                labels[current] = position
        elif line.startswith(_STOP_LINE_PREFIXES) or line.endswith(annotations.REFERENCE_SUFFIX):
            current = None
        elif current is not None and len(line) >= MIN_SEGMENT_CHARS:
            for segment in _split_line(line):
                if len(segment) >= MIN_SEGMENT_CHARS:
                    holders.setdefault(segment, (current, position))


def partial_overlap(text: str, segments: SegmentIndex, threshold: float) -> DedupDecision | None:
    """Return a "partial" decision when at least ``threshold`` of ``text``'s segment characters are held earlier.

    Pure; O(len(text)).
    """
    parts = split_segments(text)
    total = sum(len(part) for part in parts)
    if total == 0:
        return None
    present = 0
    new_segments: list[str] = []
    holders: dict[str, None] = {}
    for part in parts:
        holder = segments.holder(part) if len(part) >= MIN_SEGMENT_CHARS else None
        if holder is None:
            new_segments.append(part)
        else:
            present += len(part)
            holders[holder] = None
    if present == 0 or present < threshold * total:
        return None
    return DedupDecision(
        Status.PARTIAL, new_segments=tuple(new_segments), holder_labels=tuple(holders), saved_chars=present
    )


def decide(
    blocks: Sequence[Block],
    digests: Sequence[str],
    history: HistoryView,
    *,
    seen_hashes: frozenset[str] | Mapping[str, object] = frozenset(),
    previous_hash_for_id: Mapping[str, str] | None = None,
    segments: SegmentIndex | None = None,
    threshold: float = DEFAULT_PARTIAL_THRESHOLD,
) -> list[DedupDecision]:
    """Decide, for each block in relevance order, how it is sent (rules in the module docstring).

    Args:
        blocks: the request's blocks, best-ranked first, ids unique.
        digests: ``blocks[i].content_hash`` for each block (passed in so callers hash once).
        history: the history this request sends.
        seen_hashes: content hashes the conversation committed (to tell "resent" from "new").
        previous_hash_for_id: block id -> content hash last committed under that id.
        segments: segments of the history's blocks; None disables partial overlap.
        threshold: fraction of a block's characters that must be present for "partial".

    Returns:
        One decision per block, same order. Pure.
    """
    previous = previous_hash_for_id or {}
    # Hot path (runs for every request): the stored-transcript view is inlined as a lookup, decisions without
    # payload are shared constants, and a block's label is only computed when a given history is searched.
    committed = history.seen_hashes if type(history) is CommittedHistory else None
    use_segments = segments is not None and len(segments) > 0
    first_index: dict[str, int] = {}
    decisions: list[DedupDecision] = []
    append = decisions.append
    for index, block in enumerate(blocks):
        digest = digests[index]
        earlier = first_index.setdefault(digest, index)
        if earlier != index:
            append(DedupDecision(Status.REFERENCED, earlier, (), (), len(block.text)))
            continue
        old = previous.get(block.id) if previous else None
        if old is not None and old != digest:
            append(_CHANGED)
            continue
        present = (
            _seen_label(committed, digest) if committed is not None else history.present_label(block, digest)
        )
        if present is not None:
            append(DedupDecision(Status.REFERENCED, None, (), (), len(block.text), present))
        elif digest in seen_hashes:
            append(_RESENT)
        elif use_segments and block.text:
            append(partial_overlap(block.text, segments, threshold) or _NEW)  # type: ignore[arg-type]
        else:
            append(_NEW)
    return decisions
