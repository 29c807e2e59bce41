"""Issue 16 reproducers on the facade: each delivers everything, or raises a typed error, and stays so."""

from __future__ import annotations

import pytest

from cpmemory.core import annotations
from cpmemory.core.blocks import Block
from cpmemory.core.invariants import check_no_loss
from cpmemory.errors import CpMemoryError, InvalidInputError
from cpmemory.facade import CpMemory
from cpmemory.stores.base import ConversationKey

HARBOR = "The harbor opens at nine."
MUSEUM = "The museum closes at five."
# Two texts whose 7-hex labels collide (both D63bcc9d).
COLLIDE_X = "Fact number 24392 about the collision search corpus."
COLLIDE_Y = "Fact number 30153 about the collision search corpus."


def test_item1_repeated_id_with_other_text_reaches_the_model() -> None:
    blocks = [("a", HARBOR), ("a", MUSEUM)]
    turn = CpMemory().prepare("c", "When?", blocks)
    user = turn.messages[-1]["content"]
    assert HARBOR in user and MUSEUM in user
    assert [d.status for d in turn.decisions] == ["new", "new"]
    assert turn.decisions[0].label != turn.decisions[1].label
    assert check_no_loss(blocks, turn.messages).ok


def test_item1_same_id_same_text_is_one_block_reported_as_duplicate() -> None:
    mem = CpMemory()
    blocks = [("a", HARBOR), ("b", MUSEUM), ("a", HARBOR)]
    turn = mem.prepare("c", "When?", blocks)
    assert turn.messages[-1]["content"].count(HARBOR) == 1
    assert [(d.status, d.duplicate_of) for d in turn.decisions] == [("new", None), ("new", None), ("referenced", 0)]
    assert turn.decisions[2].label == turn.decisions[0].label
    assert turn.decisions[2].prompt_position == turn.decisions[0].prompt_position
    assert check_no_loss(blocks, turn.messages).ok
    mem.commit(turn, "ok")
    again = mem.prepare("c", "And?", [("a", HARBOR), ("a", MUSEUM)])  # renamed id is stable: MUSEUM referenced
    assert [d.status for d in again.decisions] == ["referenced", "referenced"]
    assert check_no_loss([("a", HARBOR), ("a", MUSEUM)], again.messages).ok


def test_item9_colliding_labels_in_overlapping_turns_never_give_an_ambiguous_reference() -> None:
    assert Block("x", COLLIDE_X).label == Block("y", COLLIDE_Y).label
    mem = CpMemory()
    first = mem.prepare("c", "q1", [("x", COLLIDE_X)])
    second = mem.prepare("c", "q2", [("y", COLLIDE_Y)])  # overlapping: neither sees the other's blocks
    mem.commit(second, "a2")
    mem.commit(first, "a1")  # committed out of order
    later = mem.prepare("c", "q3", [("x", COLLIDE_X), ("y", COLLIDE_Y)])
    report = check_no_loss([("x", COLLIDE_X), ("y", COLLIDE_Y)], later.messages)
    assert report.ok, report.violations
    history = "\n\n".join(m["content"] for m in later.messages[:-1])
    for decision in later.decisions:  # every label the turn uses heads at most one text in the prompt
        if decision.status == "referenced":
            assert history.count(f"[{decision.label}]\n") == 1
    mem.commit(later, "a3")
    final = mem.prepare("c", "q4", [("x", COLLIDE_X), ("y", COLLIDE_Y)])
    assert check_no_loss([("x", COLLIDE_X), ("y", COLLIDE_Y)], final.messages).ok
    assert [d.status for d in final.decisions] == ["referenced", "referenced"]  # longer labels are unique


def test_item10_abort_after_commit_never_touches_the_index() -> None:
    mem = CpMemory()
    turn = mem.prepare("c", "q", [("a", HARBOR), ("b", MUSEUM)])
    mem.commit(turn, "answer")
    assert mem.index_size() == 1
    assert mem.abort(turn) is False
    assert mem.index_size() == 1  # the committed request's leaf is still there
    assert mem.abort(turn.reservation_id) is False
    assert mem.index_size() == 1


def test_item10_an_abort_that_releases_evicts_the_leaf() -> None:
    mem = CpMemory()
    turn = mem.prepare("c", "q", [("a", HARBOR)])
    assert mem.abort(turn) is True and mem.index_size() == 0


def test_item10_commit_with_a_bad_answer_changes_nothing_and_can_be_retried() -> None:
    mem = CpMemory()
    turn = mem.prepare("c", "q", [("a", HARBOR)])
    with pytest.raises(InvalidInputError):
        mem.commit(turn.reservation_id, None)  # type: ignore[arg-type]
    assert mem.commit(turn.reservation_id, "fine") == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.prepare("c", "q", [("a", "x")], prompt_order=5),
        lambda m: m.prepare("c", "q", [("a", "x"), ("b", "y")], prompt_order="ab"),
        lambda m: m.prepare("c", "q", [("a", "x")], prompt_order=b"a"),
        lambda m: m.prepare("c", "q", [("a", "x")], history=5),
        lambda m: m.prepare("c", "q", [("a", "x")], history="hi"),
        lambda m: m.prepare("c", "q", [("a", "x")], history=[{"role": "user", "content": 5}]),
        lambda m: m.prepare("c", "q", [("a", "x")], history=[{"role": "user", "content": None}]),
        lambda m: m.prepare("c", "q", [("a", "x")], history=[{"role": "user", "content": [3]}]),
        lambda m: m.plan_batch(5),
        lambda m: m.plan_batch([5]),
        lambda m: m.evict(5),
        lambda m: m.evict([5]),
    ],
)
def test_bad_arguments_raise_typed_errors_and_change_nothing(call) -> None:
    mem = CpMemory()
    mem.commit(mem.prepare("c", "q0", [("z", "kept")]), "a0")
    before = mem.store.load(ConversationKey("default", "c"))
    with pytest.raises(CpMemoryError):
        call(mem)
    assert mem.store.load(ConversationKey("default", "c")) == before
    assert mem.index_size() == 1


def test_a_block_ending_with_an_order_lookalike_line_does_not_pass_for_the_annotation() -> None:
    other = Block("b", "The second document.")
    spoof = Block("a", "The first document.\n" + annotations.ORDER_PREFIX + f"{other.label} D0000000")
    turn = CpMemory().prepare("c", "q", [spoof, other])
    assert turn.order_annotated  # the real annotation is written, right before the question
    user = turn.messages[-1]["content"]
    before_question = user[: user.rindex("\n\nQuestion: ")].rsplit("\n", 1)[-1]
    assert before_question == annotations.ORDER_PREFIX + f"{spoof.label} {other.label}"
    assert check_no_loss([spoof, other], turn.messages).ok


def test_history_messages_keep_every_field() -> None:
    history = [
        {"role": "user", "content": "What is 6 x 7?", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "mul", "arguments": "{\"a\": 6, \"b\": 7}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "mul", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                     {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
        {"role": "assistant", "content": "A picture."},
    ]
    turn = CpMemory().prepare("c", "Why?", [("a", HARBOR)], history=history)
    assert turn.messages[1:-1] == history
    report = check_no_loss([("a", HARBOR)], turn.messages, caller_messages=history, query="Why?")
    assert report.ok, report.violations
