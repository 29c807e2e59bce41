"""Dedup rules (cpmemory.core.dedup): the paper's example, changed blocks, resent blocks, partial overlap."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.annotations import build_user_message, format_block
from cpmemory.core.blocks import Block
from cpmemory.core.dedup import (
    MIN_SEGMENT_CHARS,
    CommittedHistory,
    GivenHistory,
    SegmentIndex,
    decide,
    partial_overlap,
    split_segments,
)

TEXTS = {
    i: f"Document {i} reports that the river level rose by {i} centimetres during the storm."
    for i in range(10)
}


def blocks_of(*ids: int) -> list[Block]:
    return [Block(str(i), TEXTS[i]) for i in ids]


def statuses(blocks: list[Block], **kwargs) -> list[str]:
    digests = [b.content_hash for b in blocks]
    history = kwargs.pop("history")
    return [d.status for d in decide(blocks, digests, history, **kwargs)]


def test_paper_example_only_block_5_in_full() -> None:
    turn1 = blocks_of(1, 2, 4)
    seen = {b.content_hash: True for b in turn1}
    turn2 = blocks_of(1, 5, 2)
    assert statuses(turn2, history=CommittedHistory(seen), seen_hashes=seen) == [
        "referenced",
        "new",
        "referenced",
    ]


def test_changed_block_is_sent_in_full_even_if_old_text_is_present() -> None:
    old = Block("a", TEXTS[1])
    new = Block("a", TEXTS[1] + " Update: it fell again.")
    seen = {old.content_hash: True}
    history = GivenHistory(format_block(old.label, old.text))
    result = decide(
        [new],
        [new.content_hash],
        history,
        seen_hashes=seen,
        previous_hash_for_id={"a": old.content_hash},
        segments=SegmentIndex.from_messages([{"role": "user", "content": history.text}]),
    )
    assert [d.status for d in result] == ["changed"]


def test_seen_but_not_in_given_history_is_resent() -> None:
    blocks = blocks_of(3)
    seen = {blocks[0].content_hash: True}
    assert statuses(blocks, history=GivenHistory("truncated history"), seen_hashes=seen) == ["resent"]


def test_given_history_holding_the_labelled_text_is_referenced() -> None:
    blocks = blocks_of(3)
    text = "older turn\n\n" + format_block(blocks[0].label, blocks[0].text) + "\n\nQuestion: q"
    assert statuses(blocks, history=GivenHistory(text)) == ["referenced"]


def test_bare_text_without_its_label_is_not_a_reference() -> None:
    blocks = blocks_of(3)
    assert statuses(blocks, history=GivenHistory(blocks[0].text)) == ["new"]


def test_in_request_duplicate_content_points_to_first() -> None:
    blocks = [Block("x", TEXTS[1]), Block("y", TEXTS[2]), Block("z", TEXTS[1])]
    result = decide(blocks, [b.content_hash for b in blocks], CommittedHistory({}))
    assert [d.status for d in result] == ["new", "new", "referenced"]
    assert result[2].duplicate_of == 0


def _history_with(*blocks: Block) -> list[dict[str, str]]:
    shown = [format_block(b.label, b.text) for b in blocks]
    return [{"role": "user", "content": build_user_message(shown, [], None, "q")}]


def test_partial_overlap_sends_only_new_segments() -> None:
    earlier = Block(
        "e", "The first sentence is long enough to count. The second sentence is also long enough."
    )
    later = "The first sentence is long enough to count. A new remark."
    index = SegmentIndex.from_messages(_history_with(earlier))
    decision = partial_overlap(later, index, 0.5)
    assert decision is not None and decision.status == "partial"
    assert decision.new_segments == ("A new remark.",)
    assert decision.holder_labels == (earlier.label,)


def test_partial_threshold_is_respected() -> None:
    earlier = Block("e", "The first sentence is long enough to count.")
    later = (
        "The first sentence is long enough to count. "
        + "Then a much longer brand new sentence follows here, which dominates."
    )
    index = SegmentIndex.from_messages(_history_with(earlier))
    assert partial_overlap(later, index, 0.5) is None  # 43 of 111 segment characters present (39%)
    assert partial_overlap(later, index, 0.3) is not None


def test_short_segments_never_count_as_present() -> None:
    earlier = Block("e", "Yes.\nNo.\nMaybe.")
    index = SegmentIndex.from_messages(_history_with(earlier))
    assert len(index) == 0
    assert partial_overlap("Yes.\nNo.", index, 0.1) is None


def test_segments_in_answers_and_questions_are_not_indexed() -> None:
    sentence = "This sentence is comfortably longer than the minimum."
    history = [
        {"role": "user", "content": "Question: " + sentence},
        {"role": "assistant", "content": sentence},
    ]
    assert len(SegmentIndex.from_messages(history)) == 0


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab .!?\n\t")), max_size=80))
def test_segments_are_verbatim_substrings(text: str) -> None:
    segments = split_segments(text)
    assert all(segment and segment in text for segment in segments)
    assert sum(map(len, segments)) <= len(text)
    assert MIN_SEGMENT_CHARS > 0


def test_label_holds_only_accepts_full_and_partial_copies_and_rejects_other_text() -> None:
    from cpmemory.core.annotations import format_partial
    from cpmemory.core.dedup import label_holds_only

    text = "First sentence of the block is long enough. Second sentence of the block is long too."
    full = format_block("Dabcdef0", text)
    partial = format_partial("Dabcdef0", ["Second sentence of the block is long too."], ["D1234567"])
    assert label_holds_only(f"{full}\n\nQuestion: q\n\n{partial}", "Dabcdef0", text)
    assert label_holds_only("no header here", "Dabcdef0", text)
    assert not label_holds_only(f"{full}\n\n[Dabcdef0]\nAnother text entirely.", "Dabcdef0", text)
    assert not label_holds_only(format_block("Dabcdef0", text + " And more."), "Dabcdef0", text)
    assert not label_holds_only(format_partial("Dabcdef0", ["Not a segment of it."], []), "Dabcdef0", text)


def test_segment_index_knows_the_headers_of_the_messages_it_sees() -> None:
    history = [
        {"role": "user", "content": format_block("Dabcdef0", "x")},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": format_block("D1234567", "y")},
    ]
    index = SegmentIndex.from_messages(history)
    assert index.has_header("Dabcdef0") and index.has_header("D1234567") and not index.has_header("D7654321")
    assert not index.limited_to(2).has_header("D1234567")
