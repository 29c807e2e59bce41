"""Property tests: across random multi-turn conversations no block is ever lost and the order is recoverable."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmemory import AsyncCpMemory, CpMemory, CpMemoryConfig
from cpmemory.core.invariants import check_no_loss

SENTENCES = [f"Sentence number {i} carries a distinct fact about topic {i % 5}." for i in range(12)] + [
    "Short.",
    "",
    "Line one\nline two of a multi-line remark.",
    "Brackets [D1234567] and ] [ inside text.",
]

block_text = st.lists(st.sampled_from(SENTENCES), min_size=0, max_size=4).map(" ".join)
block_id = st.one_of(st.integers(0, 7), st.sampled_from(["a", "b", "]\n[x", "{k}:*", "\x00id"]))
request = st.lists(st.tuples(block_id, block_text), min_size=0, max_size=8)
history_mode = st.sampled_from(["stored", "stored", "stored", "full", "truncated", "none"])
outcome = st.sampled_from(["commit", "commit", "abort", "open"])
turns = st.lists(st.tuples(request, history_mode, outcome), min_size=1, max_size=8)
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def given_history(mem: CpMemory, mode: str) -> list[dict[str, str]] | None:
    if mode == "stored":
        return None
    transcript = list(mem.store.load(_key()).transcript)
    if mode == "full":
        return transcript
    if mode == "truncated":
        return transcript[len(transcript) // 2 :]
    return []


def _key():
    from cpmemory.types import ConversationKey

    return ConversationKey("default", "conv")


@SETTINGS
@given(turns, st.booleans())
def test_no_block_is_ever_lost(plan, partial: bool) -> None:
    mem = CpMemory(config=CpMemoryConfig(partial_overlap=partial))
    open_turns = []
    last_committed = None  # (messages, answer) of the last turn committed with the stored history
    for number, (blocks, mode, what) in enumerate(plan):
        turn = mem.prepare("conv", f"question {number}", blocks, history=given_history(mem, mode))
        report = check_no_loss(blocks, turn.messages)
        assert report.ok, report.violations
        if mode == "stored" and last_committed is not None and not open_turns:
            expected = last_committed[0] + [{"role": "assistant", "content": last_committed[1]}]
            assert turn.messages[: len(expected)] == expected
        if what == "commit":
            answer = f"answer {number}"
            mem.commit(turn, answer)
            last_committed = (turn.messages, answer) if mode == "stored" and not open_turns else None
        elif what == "abort":
            assert mem.abort(turn)
        else:
            open_turns.append(turn)
        mem.check_index()
    for turn in open_turns:  # late commits of concurrent turns stay consistent
        mem.commit(turn, "late")
    state = mem.store.load(_key())
    assert state.open_reservations == 0
    assert state.turns == sum(1 for _, _, what in plan if what in ("commit", "open"))


@settings(max_examples=40, deadline=None)
@given(st.lists(request, min_size=2, max_size=6))
def test_concurrent_open_turns_never_reference_each_other(requests) -> None:
    mem = CpMemory()
    prepared = [mem.prepare("conv", "q", blocks) for blocks in requests]
    for turn in prepared:
        assert {d.status for d in turn.decisions} <= {"new", "referenced"}
        referenced = [d for d in turn.decisions if d.status == "referenced"]
        labels_full = {d.label for d in turn.decisions if d.status == "new"}
        assert all(d.label in labels_full for d in referenced)  # only in-request duplicates
    for blocks, turn in zip(requests, prepared):
        assert check_no_loss(blocks, turn.messages).ok
        mem.commit(turn, "a")


@settings(max_examples=30, deadline=None)
@given(st.lists(request, min_size=1, max_size=5))
def test_async_facade_keeps_the_invariant(requests) -> None:
    async def run() -> None:
        mem = AsyncCpMemory()
        for number, blocks in enumerate(requests):
            turn = await mem.prepare("conv", f"q{number}", blocks)
            assert check_no_loss(blocks, turn.messages).ok
            await mem.commit(turn, f"a{number}")
        again = await mem.prepare("conv", "q", requests[0])
        assert check_no_loss(requests[0], again.messages).ok
        assert all(d.status != "new" for d in again.decisions if d.label in _committed_labels(mem))
        assert await mem.abort(again)

    asyncio.run(run())


def _committed_labels(mem: AsyncCpMemory) -> set[str]:
    return {seen.label for seen in mem.store.sync.load(_key()).seen.values()}
