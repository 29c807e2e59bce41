"""Cache-fit admission (cpmemory.server.fit) on its own: who is admitted where, who waits, in which order, when a
wait ends (room, idle expiry, timeout), and that a cancelled waiter leaves nothing behind. Time is a manual clock
that the tests step (:func:`step`): nothing sleeps, and no figure depends on how loaded the machine is."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cpmemory.server.clock import ManualClock
from cpmemory.server.fit import CacheFit, FitSettings

CHARS_PER_TOKEN = 4  # the default estimate: 0.25 tokens per character


def chars(tokens: int) -> int:
    return tokens * CHARS_PER_TOKEN


def make_fit(capacities: list[int | None], *, clock: ManualClock | None = None, observer: Any = None,
             **tunables: Any) -> CacheFit:
    """Admission with ``tunables`` (fields of FitSettings) on a manual clock (a new one unless given)."""
    return CacheFit(capacities, FitSettings(**tunables), clock=clock or ManualClock(), observer=observer)


async def settle() -> None:
    """Let every task that can run, run (no time passes)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def step(fit: CacheFit, seconds: float) -> None:
    """Let the tasks run, move ``fit``'s clock ``seconds`` on (its timers fire), and let them run again."""
    await settle()
    fit._clock.advance(seconds)  # type: ignore[attr-defined]
    await settle()


def test_a_new_conversation_goes_to_the_first_ranked_replica_with_room() -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0)
        a = await fit.admit("a", chars(600), 0, [0, 1])
        b = await fit.admit("b", chars(600), 0, [0, 1])  # 600 + 600 > 1000 on replica 0: replica 1 has room
        assert (a.replica, a.reason) == (0, "room")
        assert (b.replica, b.reason) == (1, "room")
        assert fit.live_tokens(0) == 600 and fit.live_tokens(1) == 600

    asyncio.run(main())


def test_a_live_conversation_keeps_its_replica_and_never_waits() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0)
        first = await fit.admit("a", chars(900), 0, [0])
        first.end(0, 950, 10)
        again = await fit.admit("a", chars(2000), 0, [0])  # larger than the cache: live, so admitted at once
        assert (again.replica, again.reason) == (0, "live")
        assert fit.live_conversations(0) == 1

    asyncio.run(main())


def test_a_conversation_waits_while_no_replica_has_room_and_enters_when_one_ends() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=0.0)
        a = await fit.admit("a", chars(700), 0, [0])
        waiting = asyncio.ensure_future(fit.admit("b", chars(700), 0, [0]))
        await step(fit, 0.05)
        assert not waiting.done() and fit.waiting == 1
        a.end(0, 700, 0)  # a goes idle; idle_s 0: its share is free at once
        b = await asyncio.wait_for(waiting, 1.0)
        assert (b.replica, b.reason) == (0, "room") and b.waited_s > 0
        assert fit.waiting == 0 and fit.live_conversations(0) == 1

    asyncio.run(main())


def test_an_idle_conversation_holds_its_share_for_idle_s_then_frees_it() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=0.6, first_idle_s=0.6, grace_s=10.0)
        a = await fit.admit("a", chars(700), 0, [0])
        a.end(0, 700, 0)
        waiting = asyncio.ensure_future(fit.admit("b", chars(700), 0, [0]))
        await step(fit, 0.1)
        assert not waiting.done()  # a may still send its next turn
        await step(fit, 0.51)
        b = await asyncio.wait_for(waiting, 3.0)  # woken by a's expiry, with nothing else happening
        assert b.reason == "room" and b.waited_s >= 0.45
        assert fit.live_conversations(0) == 1

    asyncio.run(main())


def test_a_turn_that_waited_max_wait_goes_to_the_routers_choice_over_the_cache() -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0, max_wait_s=0.1)
        await fit.admit("a", chars(800), 0, [0, 1])
        await fit.admit("b", chars(800), 0, [1, 0])
        waiting = asyncio.ensure_future(fit.admit("c", chars(800), 0, [1, 0]))
        await step(fit, 0.1)
        late = await asyncio.wait_for(waiting, 1.0)
        assert (late.replica, late.reason) == (1, "timeout")
        assert fit.live_tokens(1) == 1600

    asyncio.run(main())


def test_waiters_are_admitted_first_come_first_served() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=0.0)
        a = await fit.admit("a", chars(900), 0, [0])
        big = asyncio.ensure_future(fit.admit("big", chars(900), 0, [0]))
        await step(fit, 0.01)
        small = asyncio.ensure_future(fit.admit("small", chars(50), 0, [0]))  # it would fit beside a, but waits
        await step(fit, 0.05)
        assert not small.done()
        a.end(0, 900, 0)
        admitted = await asyncio.wait_for(big, 1.0)
        assert admitted.reason == "room"
        assert (await asyncio.wait_for(small, 1.0)).reason == "room"  # 900 + 50 <= 1000
        assert fit.live_conversations(0) == 2

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=0.0)
        a = await fit.admit("a", chars(900), 0, [0])
        gone = asyncio.ensure_future(fit.admit("gone", chars(900), 0, [0]))
        await step(fit, 0.02)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert fit.waiting == 0
        a.end(0, 900, 0)
        nxt = await asyncio.wait_for(fit.admit("next", chars(900), 0, [0]), 1.0)
        assert nxt.reason == "room" and fit.live_conversations(0) == 1  # "gone" holds no share

    asyncio.run(main())


def test_unknown_capacity_admits_everything_and_learned_tokens_per_char_follow_the_engine() -> None:
    async def main() -> None:
        fit = make_fit([None], fill=1.0)
        slots = [await fit.admit(str(i), chars(10_000), 0, [0]) for i in range(5)]
        assert all(slot.reason == "room" for slot in slots)
        for slot in slots:
            slot.end(0, 20_000, 8)  # the engine counts twice the default estimate (0.5 tokens per character)
        assert 0.25 < fit.tokens_per_char <= 0.5
        assert fit.live_tokens(0) == 5 * 20_008

    asyncio.run(main())


def test_a_slot_ends_once_and_a_failover_moves_the_conversation() -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0)
        slot = await fit.admit("a", chars(500), 0, [0, 1])
        slot.end(1, 500, 0)  # the engine call failed over to replica 1
        slot.end(1, 500, 0)  # idempotent
        assert fit.live_conversations(0) == 0 and fit.live_conversations(1) == 1
        again = await fit.admit("a", chars(500), 0, [0, 1])
        assert (again.replica, again.reason) == (1, "live")

    asyncio.run(main())


def test_bad_fill_is_rejected() -> None:
    with pytest.raises(ValueError):
        make_fit([1000], fill=0)


def test_a_conversation_outgrown_by_older_ones_waits_until_they_end_and_new_ones_do_not_overtake_it() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=1.0, first_idle_s=1.0, grace_s=10.0)  # the steps below take milliseconds
        a = await fit.admit("a", chars(500), 0, [0])
        b = await fit.admit("b", chars(400), 0, [0])
        assert b.reason == "room"
        b.end(0, 400, 0)
        a.end(0, 900, 0)  # a's history grew: a (900) + b (400) no longer fit; a is older
        a2 = await fit.admit("a", chars(900), 0, [0])
        assert a2.reason == "live"
        b_next = asyncio.ensure_future(fit.admit("b", chars(400), 0, [0]))
        await step(fit, 0.02)
        assert not b_next.done()  # suspended: a's history would be evicted by b's
        c = asyncio.ensure_future(fit.admit("c", chars(50), 0, [0]))
        await step(fit, 0.02)
        assert not c.done()  # 900 + 400 + 50 > 1000: a new conversation does not overtake b
        a2.end(0, 950, 0)  # a's last turn: a leaves once idle for idle_s
        await step(fit, 1.01)
        resumed = await asyncio.wait_for(b_next, 3.0)
        assert (resumed.replica, resumed.reason) == (0, "resumed") and resumed.waited_s > 0
        assert (await asyncio.wait_for(c, 3.0)).reason == "room"  # 400 + 50 fit now

    asyncio.run(main())


def test_a_suspended_turn_runs_after_max_wait() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=10.0, first_idle_s=10.0, grace_s=10.0, max_wait_s=0.1)
        a = await fit.admit("a", chars(500), 0, [0])
        b = await fit.admit("b", chars(400), 0, [0])
        b.end(0, 400, 0)
        a.end(0, 900, 0)
        waiting = asyncio.ensure_future(fit.admit("b", chars(400), 0, [0]))
        await step(fit, 0.1)
        late = await asyncio.wait_for(waiting, 1.0)
        assert (late.replica, late.reason) == (0, "timeout")

    asyncio.run(main())


def test_a_replica_quiet_past_grace_s_and_the_idle_window_takes_the_next_new_conversation_over_the_fill() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=0.6, first_idle_s=0.6, grace_s=0.05)
        a = await fit.admit("a", chars(900), 0, [0])
        a.end(0, 900, 0)  # nothing in flight on replica 0 from now on
        await step(fit, 0.2)
        fit.touch("a")  # a's next turn arrived and is being prepared: a stays live until 0.8 s
        b = asyncio.ensure_future(fit.admit("b", chars(900), 0, [0]))
        await step(fit, 0.1)
        assert not b.done()  # quiet for 0.3 s, past grace_s but within the idle window: a turn may be on its way
        await step(fit, 0.31)
        slot = await asyncio.wait_for(b, 2.0)
        assert slot.reason == "room" and slot.waited_s < 0.55  # woken by the grace at 0.6 s, not a's expiry
        assert fit.live_conversations(0) == 2

    asyncio.run(main())


def test_a_replica_quiet_between_turns_does_not_take_a_new_conversation_over_the_fill() -> None:
    """A conversation's next turn comes a gap after its answer; a newcomer taken over the fill in that gap would
    evict the history that turn is about to reuse (measured: a returning conversation taken this way after 100 ms
    of quiet ran its replica's live turns at 25,000 tokens on a 17,408-token cache)."""
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=0.6, first_idle_s=0.6, grace_s=0.05)
        a = await fit.admit("a", chars(900), 0, [0])
        a.end(0, 900, 0)
        b = asyncio.ensure_future(fit.admit("b", chars(900), 0, [0]))
        await step(fit, 0.2)
        assert not b.done()  # quiet for three times grace_s, but a's idle window is not over
        fit.touch("a")
        again = await fit.admit("a", chars(950), 0, [0])
        assert (again.reason, again.waited_s) == ("live", 0.0)
        assert not b.done() and fit.live_conversations(0) == 1
        b.cancel()

    asyncio.run(main())


def test_a_conversation_idled_out_early_takes_its_old_place_back_when_its_next_turn_comes_within_idle_s() -> None:
    """The learnt window releases an idle share early; a conversation whose next turn was merely slower than the
    window (within ``idle_s``) is live again ahead of the conversations admitted after it, instead of entering
    again at the back, where it would be the one to wait (and lose its history) once the others grow."""
    from cpmemory.server.fit import GAP_MIN_SAMPLES

    async def main() -> None:
        clock = ManualClock()
        fit = make_fit([1000, 1000], fill=1.0, idle_s=0.5, first_idle_s=0.5, grace_s=10.0, clock=clock)
        for turn in range(GAP_MIN_SAMPLES):
            await _continue(fit, clock, f"c{turn % 3}", 0.1)  # on replica 0: the window is learnt, 0.125 s
        a = await fit.admit("a", chars(600), 0, [1])
        b = await fit.admit("b", chars(300), 0, [1])
        a.end(1, 600, 0)
        clock.advance(0.15)
        b.end(1, 300, 0)
        clock.advance(0.01)
        fit.touch("b")
        b = await fit.admit("b", chars(500), 0, [1])  # b's turn came in time, a's has not: a's share is released
        assert fit.replica_of("a") is None and b.reason == "live"
        b.end(1, 500, 0)
        clock.advance(0.01)
        fit.touch("a")  # 0.17 s after its answer: later than the window, within idle_s
        again = await fit.admit("a", chars(650), 0, [1, 0])
        assert (again.replica, again.reason, again.waited_s) == (1, "live", 0.0)  # 650 + 500 > 1000, and a is older
        again.end(1, 650, 0)
        fit.touch("b")
        b_next = asyncio.ensure_future(fit.admit("b", chars(500), 0, [1]))
        await asyncio.sleep(0)
        assert not b_next.done()  # b, the younger, waits for a (the clock is stopped: it would wait for ever)
        b_next.cancel()
        clock.advance(0.6)
        fit.touch("a")  # beyond idle_s: a person's return, no continuation
        assert (await fit.admit("a", chars(650), 0, [1, 0])).reason == "room"

    asyncio.run(main())


def test_a_lone_question_frees_its_share_after_first_idle_s_a_conversation_after_idle_s() -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0, idle_s=10.0, first_idle_s=0.1, grace_s=10.0)
        lone = await fit.admit("lone", chars(900), 0, [0])
        lone.end(0, 900, 0)
        talk = await fit.admit("talk", chars(400), 0, [1])
        talk.end(1, 400, 0)
        talk = await fit.admit("talk", chars(800), 0, [1])  # a second turn: now it holds its share for idle_s
        talk.end(1, 800, 0)
        await step(fit, 0.2)
        first = await asyncio.wait_for(fit.admit("x", chars(900), 0, [0, 1]), 1.0)
        assert (first.replica, first.waited_s) == (0, 0.0)  # the lone question's share is free
        second = asyncio.ensure_future(fit.admit("y", chars(900), 0, [1, 0]))
        await step(fit, 0.2)
        assert not second.done()  # "talk" still holds replica 1, "x" replica 0
        second.cancel()

    asyncio.run(main())


def test_a_turn_without_history_never_waits_and_is_counted_on_the_routers_choice() -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0, grace_s=10.0)
        await fit.admit("a", chars(900), 0, [0, 1])
        lone = await asyncio.wait_for(fit.admit("q", chars(900), 0, [0, 1], history=False), 0.5)
        assert (lone.replica, lone.reason, lone.waited_s) == (0, "first", 0.0)  # the router's choice, over the fill
        assert fit.live_tokens(0) == 1800 and fit.waiting == 0

    asyncio.run(main())


def test_a_conversation_moved_to_the_replica_that_served_it_counts_there_and_may_then_wait() -> None:
    """Behind a gateway the serving replica is learnt after the turn (``move``): the conversation's share moves
    with it, and once that replica's older conversations fill it the moved one's next turn waits."""
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0, max_wait_s=5.0)
        older = await fit.admit("older", chars(700), 0, [1])
        older.end(None, 700, 0)
        first = await fit.admit("b", chars(100), 0, fit.by_room([0, 1]), history=False)
        assert first.replica == 0  # the roomiest replica, provisionally
        first.end(None, 500, 0)  # the gateway's replica is not the admission's (None keeps the pool)
        assert fit.live_tokens(0) == 500 and fit.replica_of("b") == 0
        fit.move("b", 1)  # its KV events said replica 1 served it
        assert fit.replica_of("b") == 1 and fit.live_tokens(0) == 0 and fit.live_tokens(1) == 1200
        assert fit.by_room([0, 1]) == [0, 1]
        waiting = asyncio.ensure_future(fit.admit("b", chars(500), 0, [1]))
        await step(fit, 0.01)
        assert not waiting.done()  # 700 + 500 > 1000: the older conversation keeps replica 1
        fit.move("nobody", 0)  # an unknown conversation: nothing happens
        fit.move("older", 0)  # the older one turns out to live on replica 0: b is resident on 1 now
        slot = await asyncio.wait_for(waiting, 1.0)
        assert (slot.replica, slot.reason) == (1, "resumed")

    asyncio.run(main())


def test_a_turn_that_reached_the_proxy_keeps_its_conversation_live_while_it_is_prepared() -> None:
    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=0.3, first_idle_s=0.3, grace_s=10.0)
        for turn in (1, 2):
            slot = await fit.admit("a", chars(300 * turn), 0, [0])
            slot.end(0, 300 * turn, 0)
        await step(fit, 0.2)
        fit.touch("a")  # a's third turn arrived; preparing it takes longer than what is left of the idle window
        await step(fit, 0.2)
        third = await fit.admit("a", chars(900), 0, [0])
        assert third.reason == "live"  # not expired and re-admitted as a new conversation
        third.end(0, 900, 0)
        await step(fit, 0.35)
        fit.touch("a")  # too late: its idle window had passed (a touch does not revive a conversation)
        assert (await fit.admit("a", chars(900), 0, [0])).reason == "room"

    asyncio.run(main())


def test_with_the_proxy_defaults_a_second_turn_a_few_hundred_ms_late_is_still_live() -> None:
    """A client's turnaround on a loaded machine (p90 143 ms measured, 254 ms at most) must not make its
    conversation a new one that has to find room again (what the 100 ms first-turn window did)."""
    from cpmemory.server.config import ServerConfig

    config = ServerConfig(engines=["http://127.0.0.1:1"])

    async def main() -> None:
        fit = make_fit([1000], fill=1.0, idle_s=config.fit.idle_ms / 1000, grace_s=10.0,
                       first_idle_s=config.fit.first_idle_ms / 1000)
        first = await fit.admit("a", chars(500), 0, [0], history=False)
        first.end(0, 500, 0)
        other = await fit.admit("b", chars(600), 0, [0], history=False)  # fills the cache with a
        await step(fit, 0.3)
        fit.touch("a")
        second = await asyncio.wait_for(fit.admit("a", chars(600), 0, [0]), 1.0)
        assert (second.reason, second.waited_s) == ("live", 0.0)
        other.end(0, 600, 0)

    asyncio.run(main())


async def _continue(fit: CacheFit, clock: ManualClock, key: str, gap_s: float) -> None:
    """One turn of ``key`` answered, then its next turn reaching the proxy ``gap_s`` later."""
    slot = await fit.admit(key, chars(10), 0, [0])
    slot.end(0, 10, 0)
    clock.advance(gap_s)
    fit.touch(key)


def test_the_idle_window_is_learnt_from_the_gaps_between_an_answer_and_the_next_turn() -> None:
    from cpmemory.server.fit import GAP_FLOOR_S, GAP_MARGIN, GAP_MIN_SAMPLES

    async def main() -> None:
        clock = ManualClock()
        fit = make_fit([100_000], fill=1.0, idle_s=0.5, first_idle_s=0.5, grace_s=10.0, clock=clock)
        for turn in range(GAP_MIN_SAMPLES - 1):
            await _continue(fit, clock, f"c{turn}", 0.2)
        assert fit.idle_window_s() == 0.5  # too few gaps seen: the configured window
        await _continue(fit, clock, "last", 0.2)
        assert fit.idle_window_s() == pytest.approx(GAP_MARGIN * 0.2)
        for turn in range(200):  # only fast agents now: the window follows the latest gaps, down to its floor
            await _continue(fit, clock, f"fast{turn % 7}", 0.01)
        assert fit.idle_window_s() == pytest.approx(GAP_FLOOR_S)
        await _continue(fit, clock, "person", 3.0)  # a person's next turn, seconds later, is no continuation
        assert fit.idle_window_s() == pytest.approx(GAP_FLOOR_S)

    asyncio.run(main())


def test_a_learnt_window_frees_an_idle_share_sooner_and_grows_back_when_longer_gaps_come() -> None:
    from cpmemory.server.fit import GAP_MARGIN, GAP_MIN_SAMPLES

    async def run(learn_idle: bool) -> CacheFit:
        clock = ManualClock()
        fit = make_fit([100_000], fill=1.0, idle_s=0.5, first_idle_s=0.5, grace_s=10.0, clock=clock,
                       learn_idle=learn_idle)
        for turn in range(GAP_MIN_SAMPLES):
            await _continue(fit, clock, f"c{turn % 3}", 0.1)
        slot = await fit.admit("slow", chars(10), 0, [0])
        slot.end(0, 10, 0)
        clock.advance(GAP_MARGIN * 0.1 + 0.01)  # idle past the learnt window, well within idle_s
        await fit.admit("other", chars(10), 0, [0], history=False)  # any admission expires the idle ones
        return fit

    fixed, learnt = asyncio.run(run(False)), asyncio.run(run(True))
    assert fixed.replica_of("slow") == 0  # still holding its share for 0.5 s
    assert learnt.replica_of("slow") is None  # its share is free after 0.125 s
    learnt.touch("slow")  # its next turn came 0.135 s after its answer: timed although it was no longer live
    assert learnt.idle_window_s() == pytest.approx(GAP_MARGIN * (GAP_MARGIN * 0.1 + 0.01))


def test_with_a_fixed_idle_window_the_gaps_change_nothing() -> None:
    from cpmemory.server.fit import GAP_MIN_SAMPLES

    async def main() -> None:
        clock = ManualClock()
        fit = make_fit([100_000], idle_s=0.5, first_idle_s=0.5, clock=clock, learn_idle=False)
        for turn in range(2 * GAP_MIN_SAMPLES):
            await _continue(fit, clock, f"c{turn}", 0.01)
        assert fit.idle_window_s() == 0.5

    asyncio.run(main())


async def _b_outgrown(fit: CacheFit) -> None:
    """a (older) and b live on replica 0; a's history grew to 900, so b (400) no longer fits beside it."""
    a = await fit.admit("a", chars(500), 0, [0, 1])
    b = await fit.admit("b", chars(400), 0, [0, 1])
    assert (a.replica, b.replica) == (0, 0)  # 500 + 400 fit on replica 0
    b.end(0, 400, 0)
    a.end(0, 500, 0)
    a2 = await fit.admit("a", chars(900), 0, [0, 1])
    assert a2.reason == "live"
    a2.end(0, 900, 0)  # a (900) + b (400) > 1000: b is no longer resident on replica 0


def test_a_conversation_outgrown_on_its_replica_moves_at_once_to_one_with_room() -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0, idle_s=2.0, first_idle_s=2.0, grace_s=10.0)
        await _b_outgrown(fit)
        moved = await asyncio.wait_for(fit.admit("b", chars(400), 0, [0, 1]), 1.0)
        assert (moved.replica, moved.reason, moved.waited_s) == (1, "moved", 0.0)
        assert fit.replica_of("b") == 1 and fit.live_tokens(0) == 900 and fit.live_tokens(1) == 400
        moved.end(1, 450, 0)
        again = await fit.admit("b", chars(450), 0, [0, 1])
        assert (again.replica, again.reason) == (1, "live")  # it stays where it moved

    asyncio.run(main())


@pytest.mark.parametrize("ranked", [[0], [0, 1]])
def test_a_conversation_does_not_move_off_rotation_nor_with_moves_off(ranked: list[int]) -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0, idle_s=2.0, first_idle_s=2.0, grace_s=10.0,
                       move=len(ranked) == 1)  # replica 1 out of rotation, or moves off
        await _b_outgrown(fit)
        waiting = asyncio.ensure_future(fit.admit("b", chars(400), 0, ranked))
        await step(fit, 0.05)
        assert not waiting.done() and fit.replica_of("b") == 0  # it waits for a on replica 0
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert fit.waiting == 0

    asyncio.run(main())


def test_a_waiting_conversation_moves_when_another_replica_gets_room() -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0, idle_s=2.0, first_idle_s=0.15, grace_s=10.0)
        d = await fit.admit("d", chars(900), 0, [1, 0])  # a big first turn fills replica 1 (in flight)
        assert d.replica == 1
        await _b_outgrown(fit)
        waiting = asyncio.ensure_future(fit.admit("b", chars(400), 0, [0, 1]))
        await step(fit, 0.05)
        assert not waiting.done()  # 900 + 400 > 1000 on both replicas
        d.end(1, 900, 0)  # d had a single turn: it frees replica 1 after first_idle_s
        await step(fit, 0.16)
        moved = await asyncio.wait_for(waiting, 2.0)
        assert (moved.replica, moved.reason) == (1, "moved") and moved.waited_s > 0.05
        assert fit.replica_of("b") == 1 and fit.live_tokens(0) == 900

    asyncio.run(main())


def test_a_move_does_not_overtake_a_new_conversation_waiting_for_room() -> None:
    async def main() -> None:
        fit = make_fit([1000, 1000], fill=1.0, idle_s=2.0, first_idle_s=2.0, grace_s=10.0)
        d = await fit.admit("d", chars(300), 0, [1, 0])
        assert d.replica == 1
        await _b_outgrown(fit)  # replica 0: a 900, b 400; replica 1: d 300
        newcomer = asyncio.ensure_future(fit.admit("n", chars(800), 0, [1, 0]))  # fits nowhere: waits
        await step(fit, 0.02)
        assert not newcomer.done()
        waiting = asyncio.ensure_future(fit.admit("b", chars(400), 0, [0, 1]))
        await step(fit, 0.02)
        assert not waiting.done() and fit.replica_of("b") == 0  # 300 + 400 fit on 1, but n came first
        for task in (newcomer, waiting):
            task.cancel()
        await asyncio.gather(newcomer, waiting, return_exceptions=True)
        assert fit.waiting == 0

    asyncio.run(main())


def test_a_waiting_turn_does_not_wake_admission_until_something_can_change() -> None:
    """A live conversation's turn waiting for its replica (its own idle time already past: it is not expired while
    its turn waits) and a quiet replica past its grace (for new conversations only) are times already past: the
    queue is not re-checked every millisecond for them (measured in `bench serve`: 700 re-checks per run, about 3%
    of the proxy's event loop), only when a turn ends, enters or leaves, or an idle share expires."""

    class Counting:
        def __init__(self) -> None:
            self.checks = 0

        def fit_admitted(self, reason: str, waited_s: float) -> None:
            pass

        def fit_waiting(self, waiting: int) -> None:
            self.checks += 1  # set after every pass over the queue

        def fit_idle_window(self, seconds: float) -> None:
            pass

    async def main() -> None:
        observer = Counting()
        fit = make_fit([1000, 1000], fill=1.0, idle_s=0.05, first_idle_s=0.05, grace_s=0.01, observer=observer,
                       move=False, learn_idle=False)
        a = await fit.admit("a", chars(500), 0, [0])
        b = await fit.admit("b", chars(400), 0, [0])
        b.end(0, 400, 0)
        a.end(0, 900, 0)  # a outgrew: b (younger) is no longer resident on replica 0
        a2 = await fit.admit("a", chars(900), 0, [0])
        b_next = asyncio.ensure_future(fit.admit("b", chars(400), 0, [0]))
        await step(fit, 0.1)  # b's idle time (0.05 s) and replica 1's grace (0.01 s) are now past
        before = observer.checks
        await step(fit, 0.3)
        assert not b_next.done()
        assert observer.checks - before <= 3  # was about 300: one pass per millisecond
        a2.end(0, 950, 0)  # a's turn ends: b resumes after a's idle share expires
        await step(fit, 0.06)
        resumed = await asyncio.wait_for(b_next, 2.0)
        assert resumed.reason == "resumed"

    asyncio.run(main())


def test_the_first_count_of_a_long_prompt_sets_the_estimate_and_answers_move_it_from_there() -> None:
    async def main() -> None:
        fit = make_fit([None], fill=1.0)
        assert not fit.calibrated and fit.tokens_per_char == 0.25
        fit.calibrate(999, 999)  # too short to say (the template's own tokens weigh): nothing changes
        fit.calibrate(10_000, 0)
        assert not fit.calibrated and fit.tokens_per_char == 0.25
        fit.calibrate(10_000, 3_700)  # the bench model's tokenizer on LoCoMo: 2.7 characters a token
        assert fit.calibrated and fit.tokens_per_char == pytest.approx(0.37)
        assert fit.estimate(15_000, 8) == 5_558
        fit.calibrate(10_000, 9_000)  # only the first count sets it
        assert fit.tokens_per_char == pytest.approx(0.37)
        slot = await fit.admit("a", 10_000, 0, [0])
        slot.end(0, 4_700, 0)  # an answer moves it a fifth of the way
        assert fit.tokens_per_char == pytest.approx(0.37 + 0.2 * 0.1)

    asyncio.run(main())
