"""The no-loss checker catches every way a prompt can lose a block or its order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core import annotations
from cpmemory.core.blocks import Block
from cpmemory.core.dedup import split_segments
from cpmemory.core.invariants import check_no_loss

A = Block("a", "Alpha document. It has two sentences.")
B = Block("b", "Beta document text.")
C = Block("c", "Gamma document text.")


def prompt(user: str, *history: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "sys"}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": h} for i, h in enumerate(history)]
    return messages + [{"role": "user", "content": user}]


def shown(*blocks: Block) -> list[str]:
    return [annotations.format_block(b.label, b.text) for b in blocks]


def test_all_blocks_in_full_in_relevance_order_pass() -> None:
    report = check_no_loss([A, B, C], prompt(annotations.build_user_message(shown(A, B, C), [], None, "q")))
    assert report.ok and report.full == 3


def test_missing_block_is_a_violation() -> None:
    report = check_no_loss([A, B, C], prompt(annotations.build_user_message(shown(A, C), [], None, "q")))
    assert not report.ok
    assert any("'b'" in v for v in report.violations)


def test_reference_without_text_anywhere_is_a_violation() -> None:
    report = check_no_loss([A, B], prompt(annotations.build_user_message(shown(A), [B.label], None, "q")))
    assert not report.ok


def test_reference_to_text_in_history_passes() -> None:
    earlier = annotations.build_user_message(shown(B), [], None, "q0")
    user = annotations.build_user_message(shown(A), [B.label], None, "q")
    assert check_no_loss([A, B], prompt(user, earlier, "answer")).ok


def test_text_in_history_but_not_named_now_is_a_violation() -> None:
    earlier = annotations.build_user_message(shown(B), [], None, "q0")
    user = annotations.build_user_message(shown(A), [], None, "q")
    assert not check_no_loss([A, B], prompt(user, earlier, "answer")).ok


def test_wrong_order_without_annotation_is_a_violation() -> None:
    user = annotations.build_user_message(shown(B, A), [], None, "q")
    report = check_no_loss([A, B], prompt(user))
    assert not report.ok and "order" in report.violations[0]
    assert check_no_loss([A, B], prompt(user), check_order=False).ok


def test_annotation_recovers_order() -> None:
    user = annotations.build_user_message(shown(B, A), [], [A.label, B.label], "q")
    assert check_no_loss([A, B], prompt(user)).ok
    wrong = annotations.build_user_message(shown(B, A), [], [B.label, A.label], "q")
    assert not check_no_loss([A, B], prompt(wrong)).ok


def test_partial_block_needs_every_segment() -> None:
    earlier = annotations.build_user_message(shown(Block("x", "Alpha document.")), [], None, "q0")
    ok_user = annotations.build_user_message(
        [annotations.format_partial(A.label, ["It has two sentences."], ["Dxxxxxxx"])], [], None, "q"
    )
    report = check_no_loss([A], prompt(ok_user, earlier, "ans"))
    assert report.ok and report.partial == 1
    bad_user = annotations.build_user_message(
        [annotations.format_partial(A.label, ["It has two."], ["Dxxxxxxx"])], [], None, "q"
    )
    assert not check_no_loss([A], prompt(bad_user, earlier, "ans")).ok


def test_empty_blocks_and_empty_texts() -> None:
    assert check_no_loss([], prompt("Question: q")).ok
    empty = Block("e", "")
    assert check_no_loss([empty], prompt(annotations.build_user_message(shown(empty), [], None, "q"))).ok
    assert not check_no_loss([empty], prompt("Question: q")).ok


texts = st.text(alphabet=st.sampled_from(list("abcdefgh .!?\n")), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(st.lists(texts, min_size=1, max_size=6, unique=True), st.data())
def test_removing_any_block_text_is_detected(block_texts: list[str], data: st.DataObject) -> None:
    blocks = [Block(f"b{i}", text) for i, text in enumerate(block_texts)]
    user = annotations.build_user_message(shown(*blocks), [], None, "q")
    assert check_no_loss(blocks, prompt(user)).ok
    victim = data.draw(st.sampled_from(blocks))
    elsewhere = {segment for b in blocks if b is not victim for segment in split_segments(b.text)}
    if set(split_segments(victim.text)) - elsewhere:  # some of its text exists nowhere else in the prompt
        damaged = user.replace(annotations.format_block(victim.label, victim.text), f"[{victim.label}]\n", 1)
        assert not check_no_loss(blocks, prompt(damaged)).ok
