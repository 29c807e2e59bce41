"""Bounded history (CpMemoryConfig.max_history_turns): the window rule, resent blocks, and no loss."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmemory import CpMemory, CpMemoryConfig
from cpmemory.core.blocks import Block
from cpmemory.core.invariants import check_no_loss
from cpmemory.session.turns import window_start


def test_window_start_keeps_one_to_n_turns_and_restarts_at_multiples_of_n() -> None:
    for max_turns in range(1, 7):
        previous = 0
        for turns in range(40):
            start = window_start(turns, max_turns)
            kept = turns - start
            assert 0 <= start <= turns
            assert min(turns, 1) <= kept <= max_turns
            assert start % max_turns == 0
            assert start >= previous  # the window only moves forward
            if start == previous and turns > 0:  # no restart: this turn's history extends the previous one
                assert kept == turns - 1 - window_start(turns - 1, max_turns) + 1
            previous = start
    assert all(window_start(turns, None) == 0 for turns in range(50))
    assert [window_start(turns, 3) for turns in range(9)] == [0, 0, 0, 0, 3, 3, 3, 6, 6]


def _turn(mem: CpMemory, number: int, blocks: list[Block]):
    turn = mem.prepare("conv", f"question {number}", blocks)
    assert check_no_loss(blocks, turn.messages).ok
    mem.commit(turn, f"answer {number}")
    return turn


def test_block_shown_only_in_a_dropped_turn_is_resent_in_full() -> None:
    old = Block("old", "The old block is only shown in the first turn of the conversation.")
    windowed = CpMemory(config=CpMemoryConfig(max_history_turns=2))
    unbounded = CpMemory()
    for mem in (windowed, unbounded):
        _turn(mem, 0, [old])
        for number in (1, 2):
            _turn(mem, number, [Block(f"other-{number}", f"Filler block number {number} of the chat.")])
    again_windowed = windowed.prepare("conv", "question 3", [old])
    again_unbounded = unbounded.prepare("conv", "question 3", [old])
    assert again_unbounded.decisions[0].status == "referenced"  # whole transcript: turn 1 still holds it
    assert again_windowed.dropped_turns == 2  # 3 committed turns, window of 2: restarted after turn 2
    assert again_windowed.decisions[0].status == "resent"
    assert f"[{old.label}]\n{old.text}" in again_windowed.messages[-1]["content"]
    sent = "\n".join(message["content"] for message in again_windowed.messages[:-1])
    assert old.text not in sent  # the first turn really left the prompt
    assert check_no_loss([old], again_windowed.messages).ok
    windowed.commit(again_windowed, "answer 3")
    follow_up = windowed.prepare("conv", "question 4", [old])  # resent in turn 4: referable again
    assert follow_up.decisions[0].status == "referenced"


def test_history_sent_is_bounded_and_starts_with_the_system_prompt() -> None:
    mem = CpMemory(config=CpMemoryConfig(max_history_turns=3))
    for number in range(12):
        turn = _turn(mem, number, [Block(f"b{number}", f"Block {number} has its own text.")])
        assert turn.messages[0]["role"] == "system"
        history = turn.messages[1:-1]
        assert len(history) <= 2 * 3
        assert len(history) == 2 * (number - turn.dropped_turns)


SENTENCES = [f"Sentence {i} states a distinct fact about subject {i % 4} today." for i in range(10)]
block_text = st.lists(st.sampled_from(SENTENCES), min_size=1, max_size=3).map(" ".join)
request = st.lists(st.tuples(st.integers(0, 9), block_text), min_size=0, max_size=6)
outcome = st.sampled_from(["commit", "commit", "commit", "abort"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(request, outcome), min_size=1, max_size=10), st.integers(1, 3), st.booleans())
def test_no_loss_with_a_small_history_window(plan, max_turns: int, partial: bool) -> None:
    mem = CpMemory(config=CpMemoryConfig(max_history_turns=max_turns, partial_overlap=partial))
    previous = None  # (messages + answer, dropped turns) of the last committed turn
    for number, (blocks, what) in enumerate(plan):
        turn = mem.prepare("conv", f"question {number}", blocks)
        report = check_no_loss(blocks, turn.messages)
        assert report.ok, report.violations
        assert len(turn.messages) <= 2 * max_turns + 2
        if previous is not None and previous[1] == turn.dropped_turns:  # same window: the prefix is kept
            assert turn.messages[: len(previous[0])] == previous[0]
        if what == "abort":
            assert mem.abort(turn)
            continue
        mem.commit(turn, f"answer {number}")
        previous = (
            turn.messages + [{"role": "assistant", "content": f"answer {number}"}],
            turn.dropped_turns,
        )
