"""The facade's online paths: prepare without prompt_order, order_blocks (no conversation), release_order."""
from __future__ import annotations

import pytest

from cpmemory.core.invariants import check_no_loss
from cpmemory.errors import InvalidInputError
from cpmemory.facade import CpMemory

TEXTS = {i: f"Document {i}: " + "word " * (5 + 3 * i) for i in range(10)}


def blocks(*ids):
    return [{"id": str(i), "text": TEXTS[i]} for i in ids]


def test_a_later_request_holding_an_earlier_order_starts_with_it():
    mem = CpMemory()
    first = mem.prepare("a", "q", blocks(3, 1, 2))
    mem.commit(first, "x")
    second = mem.prepare("b", "q", blocks(7, 2, 1, 3))
    assert second.prompt_order[:3] == first.prompt_order
    assert check_no_loss(blocks(7, 2, 1, 3), second.messages).ok


def test_order_blocks_records_no_conversation_and_is_shared_by_later_requests():
    mem = CpMemory()
    ordered = mem.order_blocks(blocks(4, 5, 6))
    assert sorted(block.id for block in ordered) == ["4", "5", "6"]
    assert mem.counters.snapshot()["prepares"] == 0  # no turn, no reservation, nothing for a conversation
    turn = mem.prepare("c", "q", blocks(6, 5, 4, 9))
    assert turn.prompt_order[:3] == [block.id for block in ordered]
    assert mem.index_size() == 2
    mem.check_index()


def test_release_order_plans_the_window_and_prepare_uses_its_orders():
    mem = CpMemory()
    waiting = [blocks(1, 2, 3), blocks(7, 8), blocks(4, 3, 2), blocks(9, 8, 7)]
    order = mem.release_order(waiting)
    assert order == [0, 1, 2, 3]
    turns = [mem.prepare(f"c{i}", "q", waiting[i]) for i in order]
    for turn in turns:
        mem.commit(turn, "a")
    # the blocks a later waiting request shares come first, so it starts with the earlier one's prefix
    assert set(turns[0].prompt_order[:2]) == {"2", "3"} and turns[2].prompt_order[:2] == turns[0].prompt_order[:2]
    assert set(turns[1].prompt_order) == {"7", "8"} and turns[3].prompt_order[:2] == turns[1].prompt_order
    mem.check_index()


def test_release_order_plans_a_window_that_outgrows_the_cache_as_a_batch():
    mem = CpMemory()
    # two clusters arriving in turn; about 12 x 4 blocks of ~30 characters: ~370 tokens at 4 characters a token
    waiting = [blocks(1, 2, 3, 4 + number // 2 % 2) if number % 2 == 0 else blocks(6, 7, 8, 9 * (number // 2 % 2))
               for number in range(12)]
    assert mem.release_order(waiting, cache_tokens=10_000) == list(range(12))  # it fits: as it came
    order = mem.release_order(waiting, cache_tokens=20)
    assert sorted(order) == list(range(12))
    assert [position % 2 for position in order] in ([0] * 6 + [1] * 6, [1] * 6 + [0] * 6)  # clusters back to back
    turns = [mem.prepare(f"c{position}", "q", waiting[position]) for position in order]
    for position, turn in zip(order, turns):
        assert check_no_loss(waiting[position], turn.messages).ok
        mem.commit(turn, "a")
    for cluster, shared in ((0, {"1", "2", "3"}), (1, {"6", "7", "8"})):
        firsts = {tuple(turn.prompt_order[:3]) for position, turn in zip(order, turns) if position % 2 == cluster}
        assert len(firsts) == 1 and set(next(iter(firsts))) == shared  # one shared prefix per cluster
    with pytest.raises(InvalidInputError):
        mem.release_order(waiting, cache_tokens=-1)
    mem.check_index()


def test_eviction_reaches_the_online_order():
    mem = CpMemory()
    first = mem.prepare("a", "q", blocks(1, 2))
    mem.commit(first, "x")
    assert mem.evict([first.request_id]) == 1
    mem.check_index()


def test_only_a_history_without_user_or_assistant_turns_opens_a_conversation():
    from cpmemory.session.turns import opens_conversation

    assert opens_conversation(None) and opens_conversation(()) and opens_conversation([{"role": "system",
                                                                                         "content": "s"}])
    assert not opens_conversation([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}])
    assert not opens_conversation([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])


def test_release_plan_splits_a_window_that_outgrows_the_caches_one_cluster_a_lane():
    mem = CpMemory()
    waiting = [blocks(1, 2, 3, 4 + number // 2 % 2) if number % 2 == 0 else blocks(6, 7, 8, 9 * (number // 2 % 2))
               for number in range(12)]
    fits = mem.release_plan(waiting, cache_tokens=10_000, lanes=2)
    assert list(fits.order) == list(range(12)) and set(fits.lanes) == {None}  # it fits: as it came, not split
    plan = mem.release_plan(waiting, cache_tokens=20, lanes=2)
    assert sorted(plan.order) == list(range(12))
    assert {plan.lanes[position] for position in range(0, 12, 2)} != {plan.lanes[position] for position in range(1, 12, 2)}
    assert all(len({plan.lanes[position] for position in range(cluster, 12, 2)}) == 1 for cluster in (0, 1))
    assert [plan.lanes[position] for position in plan.order] in ([0, 1] * 6, [1, 0] * 6)  # dealt one a lane in turn
    turns = [mem.prepare(f"c{position}", "q", waiting[position]) for position in plan.order]
    for position, turn in zip(plan.order, turns):
        assert check_no_loss(waiting[position], turn.messages).ok
        mem.commit(turn, "a")
    one = mem.release_plan(waiting, cache_tokens=20, lanes=1)
    assert set(one.lanes) == {0} and sorted(one.order) == list(range(12))
    mem.check_index()


@pytest.mark.parametrize("lanes", [0, -1, True, 1.5, "2"])
def test_release_plan_rejects_bad_lanes_and_records_nothing(lanes):
    mem = CpMemory()
    before = mem.index_size()
    with pytest.raises(InvalidInputError):
        mem.release_plan([blocks(1, 2)], cache_tokens=20, lanes=lanes)
    assert mem.index_size() == before
