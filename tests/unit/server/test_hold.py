"""The hold-and-release queue (cpmemory.server.hold), on its own: who waits, when a window is released, in which
order, and that a cancelled waiter leaves nothing behind. Time is a manual clock the tests step: nothing sleeps."""
from __future__ import annotations

import asyncio

import pytest

from cpmemory.core.blocks import Block
from cpmemory.core.scheduling import ReleasePlan
from cpmemory.facade import AsyncCpMemory
from cpmemory.server.clock import ManualClock
from cpmemory.server.hold import HoldQueue

LONG = 30.0  # a hold that never expires within a test: releases come from slots


async def settle() -> None:
    """Let every task that can run, run (no time passes)."""
    for _ in range(10):
        await asyncio.sleep(0)


def blocks(*ids: int) -> tuple[Block, ...]:
    return tuple(Block(str(i), f"document {i} " + "word " * (4 + i)) for i in ids)


class Recorder:
    """A HoldObserver that keeps what it was told."""

    def __init__(self) -> None:
        self.releases: list[tuple[str, str, int]] = []
        self.cancels = 0
        self.failures = 0
        self.held_now: list[int] = []
        self.send_timeouts = 0

    def held(self, waiting: int) -> None:
        self.held_now.append(waiting)

    def released(self, reason, order, waits_s) -> None:
        self.releases.append((reason, order, len(waits_s)))

    def cancelled(self, waiting: int) -> None:
        self.cancels += 1

    def planner_failed(self) -> None:
        self.failures += 1

    def send_timed_out(self) -> None:
        self.send_timeouts += 1


async def start_waiters(queue: HoldQueue, requests, tenant: str = "t"):
    """One task per request, each appending (its name, its admission) once admitted; returns (tasks, admitted)."""
    admitted: list = []

    async def wait(name, request_blocks, who):
        admission = await queue.admit(who, request_blocks)
        admitted.append((name, admission))
        return admission

    tasks = []
    for name, request_blocks, *who in requests:
        tasks.append(asyncio.ensure_future(wait(name, request_blocks, who[0] if who else tenant)))
        await asyncio.sleep(0)  # each reaches the queue before the next: arrival order is the list's
    return tasks, admitted


def reverse_planner(calls: list):
    def plan(requests, tenant):
        calls.append((tenant, len(requests)))
        return list(reversed(range(len(requests))))

    return plan


async def test_below_the_bound_nobody_waits_and_a_slot_releases_the_window_in_planner_order():
    calls: list = []
    recorder = Recorder()
    queue = HoldQueue(2, LONG, planner=reverse_planner(calls), observer=recorder)
    first, second = queue.try_admit(), await queue.admit("t", blocks(1))
    assert first is not None and first.reason == "immediate" and second.reason == "immediate"
    assert queue.try_admit() is None and queue.admitted == 2
    tasks, admitted = await start_waiters(queue, [("a", blocks(1, 2)), ("b", blocks(2, 3)), ("c", blocks(3, 4))])
    assert queue.waiting == 3 and admitted == [] and recorder.held_now == [1, 2, 3]
    first.done()
    await asyncio.gather(*tasks)
    assert [name for name, _ in admitted] == ["c", "b", "a"]  # the planner's order, not the arrival order
    assert [admission.position for _, admission in admitted] == [0, 1, 2]
    assert {admission.reason for _, admission in admitted} == {"slot"}
    assert calls == [("t", 3)]
    assert recorder.releases == [("slot", "planner", 3)]
    assert queue.waiting == 0 and queue.admitted == 4  # the whole window runs, past the bound
    first.done()  # idempotent: the slot is given back once
    assert queue.admitted == 4
    for _, admission in admitted:
        admission.done()
    second.done()
    assert queue.admitted == 0


async def test_the_oldest_waits_at_most_hold_s_then_every_held_request_is_released():
    recorder = Recorder()
    hold_s = 0.03
    clock = ManualClock()
    queue = HoldQueue(1, hold_s, planner=reverse_planner([]), observer=recorder, clock=clock)
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [("a", blocks(1)), ("b", blocks(2))])
    clock.advance(hold_s - 0.001)
    await settle()
    assert not admitted  # not yet
    clock.advance(0.001)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert running is not None and queue.admitted == 3
    assert {admission.reason for _, admission in admitted} == {"timeout"}
    assert all(admission.waited_s == pytest.approx(hold_s) for _, admission in admitted)
    assert recorder.releases == [("timeout", "planner", 2)]


async def test_a_failing_planner_releases_first_come_first_served():
    def broken(requests, tenant):
        raise RuntimeError("planner down")

    recorder = Recorder()
    queue = HoldQueue(1, LONG, planner=broken, observer=recorder)
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [("a", blocks(1)), ("b", blocks(2)), ("c", blocks(3))])
    running.done()
    await asyncio.gather(*tasks)
    assert [name for name, _ in admitted] == ["a", "b", "c"]
    assert recorder.releases == [("slot", "fcfs", 3)] and recorder.failures == 1


@pytest.mark.parametrize("answer", [[0, 0], [0], [0, 1, 2], ["x", 1]])
async def test_a_planner_answer_that_is_not_a_permutation_is_not_followed(answer):
    recorder = Recorder()
    queue = HoldQueue(1, LONG, planner=lambda requests, tenant: answer, observer=recorder)
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [("a", blocks(1)), ("b", blocks(2))])
    running.done()
    await asyncio.gather(*tasks)
    assert [name for name, _ in admitted] == ["a", "b"]
    assert recorder.failures == 1 and recorder.releases == [("slot", "fcfs", 2)]


async def test_without_a_planner_the_release_is_fcfs():
    queue = HoldQueue(1, LONG)
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [("a", blocks(1)), ("b", blocks(2))])
    running.done()
    await asyncio.gather(*tasks)
    assert [name for name, _ in admitted] == ["a", "b"]


async def test_each_tenant_is_planned_apart_and_plain_requests_keep_their_place():
    calls: list = []
    queue = HoldQueue(1, LONG, planner=reverse_planner(calls))
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [
        ("x1", blocks(1), "x"), ("plain", ()), ("y1", blocks(2), "y"), ("x2", blocks(3), "x"), ("x3", blocks(4), "x"),
    ])
    running.done()
    await asyncio.gather(*tasks)
    # x's requests swap among x's positions (0, 3, 4); the plain one and y's lone request stay where they arrived
    assert [name for name, _ in admitted] == ["x3", "plain", "y1", "x2", "x1"]
    assert calls == [("x", 3)]  # a lone request of a tenant is not planned (prepare orders it)


async def test_a_cancelled_waiter_leaves_the_queue_and_the_rest_are_still_released():
    recorder = Recorder()
    queue = HoldQueue(1, LONG, planner=reverse_planner([]), observer=recorder)
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [("a", blocks(1)), ("b", blocks(2)), ("c", blocks(3))])
    tasks[1].cancel()
    await asyncio.sleep(0)
    assert queue.waiting == 2 and recorder.cancels == 1
    running.done()
    await asyncio.gather(tasks[0], tasks[2])
    assert [name for name, _ in admitted] == ["c", "a"]
    assert queue.admitted == 2 and recorder.releases == [("slot", "planner", 2)]


async def test_the_only_waiter_cancelled_stops_the_timer():
    recorder = Recorder()
    clock = ManualClock()
    queue = HoldQueue(1, 0.02, observer=recorder, clock=clock)
    running = queue.try_admit()
    tasks, _ = await start_waiters(queue, [("a", blocks(1))])
    assert clock.pending == 1
    tasks[0].cancel()
    await settle()
    assert clock.pending == 0  # the window's timer went with its only waiter
    clock.advance(0.05)
    assert queue.waiting == 0 and recorder.releases == [] and queue.admitted == 1
    running.done()
    assert queue.admitted == 0


async def test_a_waiter_cancelled_after_its_release_gives_its_slot_back():
    queue = HoldQueue(1, LONG)
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [("a", blocks(1)), ("b", blocks(2))])
    running.done()  # releases both: their futures hold admissions, their tasks have not resumed yet
    assert queue.admitted == 2
    tasks[0].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert [name for name, _ in admitted] == ["b"] and queue.admitted == 1


async def test_held_requests_are_never_overtaken_and_the_bound_follows_the_healthy_replicas():
    healthy = [1]
    queue = HoldQueue(2, LONG, replicas=lambda: healthy[0])
    running = [queue.try_admit(), queue.try_admit()]
    assert queue.capacity() == 2 and queue.try_admit() is None
    tasks, _ = await start_waiters(queue, [("a", blocks(1))])
    healthy[0] = 3  # two replicas came back: free slots, but "a" waits first
    assert queue.capacity() == 6 and queue.try_admit() is None
    running[0].done()
    await asyncio.gather(*tasks)
    assert queue.try_admit() is not None
    healthy[0] = 0  # every replica down: one replica's worth is still admitted (the call then fails fast)
    assert queue.capacity() == 2


def test_bad_bounds_are_rejected():
    with pytest.raises(ValueError):
        HoldQueue(0, 0.005)
    with pytest.raises(ValueError):
        HoldQueue(1, 0.0)
    with pytest.raises(ValueError):
        HoldQueue(None, 0.005)  # no bound at all


async def test_the_token_bound_holds_what_would_overflow_the_caches_and_a_finished_request_releases_the_window():
    budget = [10_000]
    recorder = Recorder()
    queue = HoldQueue(None, LONG, token_budget=lambda: budget[0], planner=reverse_planner([]), observer=recorder)
    assert queue.capacity() is None and queue.counts_tokens and not HoldQueue(1, LONG).counts_tokens
    first = queue.try_admit(6_000)
    second = queue.try_admit(4_000)  # 10,000: exactly the budget
    assert first is not None and second is not None and queue.tokens == 10_000 and queue.admitted == 2
    assert queue.try_admit(1) is None  # one token more overflows
    waiters = [asyncio.ensure_future(queue.admit("t", blocks(i), 3_000)) for i in (1, 2, 3)]
    await asyncio.sleep(0)
    assert queue.waiting == 3
    second.done()  # 6,000 in flight: room again, the whole window goes (past the budget, as with the count)
    released = await asyncio.gather(*waiters)
    assert {admission.reason for admission in released} == {"slot"} and queue.waiting == 0
    assert queue.tokens == 6_000 + 3 * 3_000 and queue.admitted == 4
    assert recorder.releases == [("slot", "planner", 3)]
    for admission in [first, *released]:
        admission.done()
        admission.done()  # idempotent: its tokens are given back once
    assert queue.tokens == 0 and queue.admitted == 0


async def test_one_request_always_runs_and_an_unknown_budget_bounds_nothing():
    budget: list[int | None] = [1_000]
    queue = HoldQueue(None, LONG, token_budget=lambda: budget[0])
    huge = queue.try_admit(50_000)  # larger than the caches: it still runs when nothing else does
    assert huge is not None and queue.try_admit(10) is None
    huge.done()
    budget[0] = None  # the engines' sizes are not read yet: nothing is held
    admitted = [queue.try_admit(50_000) for _ in range(5)]
    assert all(admission is not None for admission in admitted) and queue.tokens == 250_000


async def test_with_both_bounds_either_one_holds():
    queue = HoldQueue(2, LONG, token_budget=lambda: 10_000)
    small = [queue.try_admit(10), queue.try_admit(10)]
    assert all(small) and queue.try_admit(10) is None  # the count binds
    small[0].done()
    assert queue.try_admit(9_991) is None  # one slot is free, but the tokens bind: 10 + 9,991 > 10,000
    assert queue.try_admit(9_990) is not None and queue.tokens == 10_000


async def test_with_the_facade_as_planner_the_window_s_shared_blocks_lead():
    """The real planner (the waiters are tenant "t"): the first waiting request puts first the blocks the later ones
    hold, as the window planner decided (prepared for the same tenant, the planned orders are used)."""
    memory = AsyncCpMemory()
    queue = HoldQueue(1, LONG, planner=lambda requests, tenant: memory.release_order(requests, tenant=tenant))
    running = queue.try_admit()
    window = [blocks(1, 2, 3), blocks(7, 8), blocks(4, 3, 2), blocks(9, 8, 7)]
    tasks, admitted = await start_waiters(queue, [(str(i), request) for i, request in enumerate(window)])
    running.done()
    await asyncio.gather(*tasks)
    assert [name for name, _ in admitted] == ["0", "1", "2", "3"]  # today's window planner keeps arrival order
    turns = [await memory.prepare(f"c{name}", "q", window[int(name)], tenant="t") for name, _ in admitted]
    assert set(turns[0].prompt_order[:2]) == {"2", "3"} and turns[2].prompt_order[:2] == turns[0].prompt_order[:2]
    assert turns[3].prompt_order[:2] == turns[1].prompt_order


async def test_a_released_window_is_sent_in_its_planned_order():
    """Released together, the requests would reach the engines in whatever order their preparation and connections
    took: each waits until the one before it in the window was sent, and a request that is never sent (it failed,
    its client went away) does not hold the rest back."""
    queue = HoldQueue(1, LONG, planner=reverse_planner([]))
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [("a", blocks(1)), ("b", blocks(2)), ("c", blocks(3))])
    running.done()
    await asyncio.gather(*tasks)
    by_name = dict(admitted)
    order: list[str] = []

    async def send(name: str, slow: bool) -> None:
        if slow:
            await settle()  # a slower preparation than the ones released after it
        await by_name[name].in_turn(timeout_s=5)
        order.append(name)
        by_name[name].sent()

    await asyncio.wait_for(asyncio.gather(send("c", True), send("b", False), send("a", False)), timeout=5)
    assert order == ["c", "b", "a"]  # the planner's order, though b and a were ready first
    # a request released and never sent gives way at once (done), and a lost turn costs at most the timeout
    clock = ManualClock()
    queue2 = HoldQueue(1, LONG, planner=reverse_planner([]), clock=clock)
    running2 = queue2.try_admit()
    tasks2, admitted2 = await start_waiters(queue2, [("a", blocks(1)), ("b", blocks(2)), ("c", blocks(3))])
    running2.done()
    await asyncio.gather(*tasks2)
    first, second, third = (admission for _, admission in admitted2)
    first.done()  # it failed before it was sent
    await asyncio.wait_for(second.in_turn(timeout_s=5), timeout=1)
    third_turn = asyncio.ensure_future(third.in_turn(timeout_s=0.05))
    await settle()
    assert not third_turn.done()
    clock.advance(0.05)
    await asyncio.wait_for(third_turn, timeout=1)  # second never says sent: the wait is bounded


async def release_window(planner, names: str, recorder: Recorder, clock: ManualClock | None = None):
    """A queue of one slot with ``planner`` (on ``clock``): the slot taken, one waiter per name, the slot freed;
    returns the (name, admission) pairs in release order."""
    queue = HoldQueue(1, LONG, planner=planner, observer=recorder, clock=clock or ManualClock())
    running = queue.try_admit()
    tasks, admitted = await start_waiters(queue, [(name, blocks(i)) for i, name in enumerate(names)])
    running.done()
    await asyncio.gather(*tasks)
    return admitted


async def test_a_split_plan_gives_each_released_request_its_lane_and_one_lane_map_per_release():
    recorder = Recorder()
    plan = ReleasePlan((2, 0, 3, 1), (0, 1, 0, 1))
    admitted = await release_window(lambda requests, tenant: plan, "abcd", recorder)
    assert [name for name, _ in admitted] == ["c", "a", "d", "b"]
    assert {name: admission.lane for name, admission in admitted} == {"a": 0, "b": 1, "c": 0, "d": 1}
    maps = {id(admission.lanes) for _, admission in admitted}
    assert len(maps) == 1 and admitted[0][1].lanes is not None
    lanes = admitted[0][1].lanes
    assert lanes.replica(0) is None
    lanes.claim(0, 1)
    assert lanes.replica(0) == 1 and lanes.taken(1) == {1} and lanes.taken(0) == set()
    assert recorder.releases == [("slot", "planner", 4)]


async def test_a_plan_whose_lanes_do_not_match_the_window_is_not_followed():
    recorder = Recorder()
    admitted = await release_window(lambda requests, tenant: ReleasePlan((1, 0), (0,)), "ab", recorder)
    assert [name for name, _ in admitted] == ["a", "b"] and {a.lane for _, a in admitted} == {None}
    assert recorder.failures == 1


async def test_a_request_whose_predecessor_is_not_sent_in_time_goes_on_and_is_counted():
    recorder = Recorder()
    clock = ManualClock()
    admitted = await release_window(reverse_planner([]), "ab", recorder, clock)
    first, second = (admission for _, admission in admitted)
    await first.in_turn(0.01)  # the first of its release never waits
    assert recorder.send_timeouts == 0
    turn = asyncio.ensure_future(second.in_turn(0.01))
    await settle()
    assert not turn.done()
    clock.advance(0.01)
    await turn  # the first was never sent: it goes on after the limit
    assert recorder.send_timeouts == 1
    first.sent()
    await second.in_turn(0.01)
    assert recorder.send_timeouts == 1


async def test_a_split_window_keeps_each_lane_in_order_without_waiting_for_the_other_lanes():
    recorder = Recorder()
    plan = ReleasePlan((0, 1, 2, 3), (0, 1, 0, 1))
    admitted = await release_window(lambda requests, tenant: plan, "abcd", recorder)
    a, b, c, d = (admission for _, admission in admitted)
    await asyncio.wait_for(b.in_turn(5), 1)  # lane 1's first waits for nobody, though lane 0's first is not sent
    waiting = asyncio.ensure_future(c.in_turn(5))
    await settle()
    assert not waiting.done()  # lane 0's second waits for lane 0's first
    b.sent()
    await asyncio.wait_for(d.in_turn(5), 1)  # lane 1's second follows lane 1's first
    assert not waiting.done()
    a.sent()
    await asyncio.wait_for(waiting, 1)
    assert recorder.send_timeouts == 0


async def test_the_send_limit_counts_from_the_turn_of_the_one_before_so_a_long_window_keeps_its_order():
    recorder = Recorder()
    clock = ManualClock()
    admitted = await release_window(lambda requests, tenant: list(range(len(requests))), "abcdef", recorder, clock)
    sent_order: list[int] = []

    async def send(index, admission):
        await admission.in_turn(0.2)  # each link waits at most 0.2 s once the one before got its turn
        clock.advance(0.08)  # a send takes 0.08 s: the window takes 0.48 s, more than the limit
        sent_order.append(index)
        admission.sent()

    await asyncio.gather(*(send(index, admission) for index, (_, admission) in enumerate(admitted)))
    assert sent_order == list(range(6)) and recorder.send_timeouts == 0
