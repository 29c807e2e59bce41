"""Labels of one prompt: unique per text within the prompt (history sent + this turn).

A label is "D" + the first ``label_digits`` (7) hex digits of the content hash, so two different texts can share
one (about 1 in 270 million per pair). When a block's label already names another text in the prompt, the block
gets a longer label: ``collision_label_digits`` (12) digits of the same hash, then the whole hash. Choices, in this
order, so that a block keeps one label for the whole conversation:

1. a block referenced from the history uses the label the history shows it under (dedup found it there);
2. an in-request duplicate uses the label of the block it duplicates;
3. any other block shown (in full or in part) tries the label it was last committed under, then its candidates
   shortest first (``cpmemory.core.dedup.label_candidates``), and takes the first that no other text of the
   prompt uses: not given to another block of this turn, and not the header of another text in the history sent
   (``label_holds_only``). Blocks of this turn are served in relevance order: the less relevant of two colliding
   blocks gets the longer label.

The no-loss check (cpmemory.core.invariants) reads the label each block got from the prompt and fails when a label
names two texts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cpmemory.core.blocks import Block, label_for_hash
from cpmemory.core.dedup import DedupDecision, SegmentIndex, label_candidates, label_holds_only
from cpmemory.types import Message, SeenBlock, Status


@dataclass(frozen=True, slots=True)
class LabelContext:
    """What label assignment knows about the history sent.

    Attributes:
        messages: the history sent.
        segments: its segment index (knows which labels head a block in the history), or None for no history.
        seen: content hash -> SeenBlock committed (its ``label`` is the one the block was last shown under).
        digits: the label length; longer: the length used on a collision.
    """

    messages: Sequence[Message] = ()
    segments: SegmentIndex | None = None
    seen: Mapping[str, SeenBlock] | None = None
    digits: int = 7
    longer: int = 12


def assign_labels(
    blocks: Sequence[Block], digests: Sequence[str], decisions: Sequence[DedupDecision], context: LabelContext
) -> list[str]:
    """Return one label per block (rules in the module docstring). Pure; O(k) plus O(history) per collision."""
    labels = [""] * len(blocks)
    owner: dict[str, str] = {}  # label -> content hash, for this prompt
    for i, decision in enumerate(decisions):
        if decision.status == Status.REFERENCED and decision.duplicate_of is None:
            labels[i] = decision.label or label_for_hash(digests[i], context.digits)
            owner.setdefault(labels[i], digests[i])
    history_text = _lazy_text(context.messages)
    for i, decision in enumerate(decisions):
        if labels[i]:
            continue
        if decision.duplicate_of is not None:  # an earlier block of this request: labelled already
            labels[i] = labels[decision.duplicate_of]
        else:
            labels[i] = _shown_label(i, blocks, digests, context, owner, history_text)
        owner.setdefault(labels[i], digests[i])
    return labels


def _shown_label(
    i: int,
    blocks: Sequence[Block],
    digests: Sequence[str],
    context: LabelContext,
    owner: Mapping[str, str],
    history_text: Callable[[], str],
) -> str:
    digest = digests[i]
    previous = context.seen.get(digest) if context.seen else None
    short = label_for_hash(digest, context.digits)
    if (previous is None or previous.label == short) and owner.get(short, digest) == digest and not (
        context.segments is not None and context.segments.has_header(short)
    ):  # the usual case, decided without building the longer candidates (the loop below would pick it first)
        return short
    candidates = label_candidates(digest, context.digits, context.longer)
    if previous is not None and previous.label in candidates:
        candidates.insert(0, previous.label)
    for label in candidates:
        if owner.get(label, digest) != digest:
            continue
        contested = context.segments is not None and context.segments.has_header(label)
        if contested and not label_holds_only(history_text(), label, blocks[i].text):
            continue
        return label
    return candidates[-1]  # the whole hash: two texts sharing it are the same text in practice


def _lazy_text(messages: Sequence[Message]) -> Callable[[], str]:
    cache: list[str] = []

    def text() -> str:
        if not cache:
            cache.append("\n\n".join(message["content"] for message in messages))
        return cache[0]

    return text
