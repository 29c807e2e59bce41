"""Many threads / tasks on one facade: no loss, exact turn counts, a consistent index."""

from __future__ import annotations

import asyncio
import threading

from cpmemory import AsyncCpMemory, CpMemory
from cpmemory.core.invariants import check_no_loss
from cpmemory.types import ConversationKey

DOCS = [f"Passage {i}: the archive lists {i * 3} letters written during year {1900 + i}." for i in range(60)]


def request(seed: int) -> list[tuple[str, str]]:
    ids = [(seed * 7 + j * 11) % len(DOCS) for j in range(8)]
    return [(f"d{i}", DOCS[i]) for i in dict.fromkeys(ids)]


def test_threads_share_one_facade() -> None:
    mem = CpMemory()
    failures: list[str] = []

    def worker(worker_id: int) -> None:
        for turn in range(30):
            blocks = request(worker_id * 100 + turn)
            conversation = "shared" if turn % 3 == 0 else f"own-{worker_id}"
            prepared = mem.prepare(conversation, f"q{turn}", blocks)
            report = check_no_loss(blocks, prepared.messages)
            if not report.ok:
                failures.extend(report.violations)
            mem.commit(prepared, f"a{turn}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert mem.store.load(ConversationKey("default", "shared")).turns == 4 * 10
    assert mem.counters.snapshot()["commits"] == 120
    mem.check_index()  # the tree itself must still be consistent


async def test_tasks_on_one_conversation() -> None:
    mem = AsyncCpMemory()
    blocks = [request(i) for i in range(20)]
    turns = await asyncio.gather(*(mem.prepare("c", f"q{i}", b) for i, b in enumerate(blocks)))
    assert all({d.status for d in t.decisions} <= {"new"} for t in turns)
    numbers = await asyncio.gather(*(mem.commit(t, "a") for t in turns))
    assert sorted(numbers) == list(range(1, 21))
    again = await mem.prepare("c", "q", blocks[0])
    assert {d.status for d in again.decisions} == {"referenced"}
    assert check_no_loss(blocks[0], again.messages).ok
