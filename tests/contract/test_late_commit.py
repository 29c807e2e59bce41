"""A turn answered after its reservation timed out: ``commit(late=True)`` records it on every store backend (the
proxy's case: admission, a queued engine or a long stream outlast the reservation), ``commit()`` still refuses."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from cpmemory import AsyncCpMemory, CpMemory, CpMemoryConfig
from cpmemory.errors import ReservationExpiredError

CONFIG = CpMemoryConfig(reservation_timeout_s=0.05)
BLOCKS = [{"id": "doc-1", "text": "The bridge opened in 1932 after six years of work."},
          {"id": "doc-2", "text": "Its main span is 503 metres long."}]


async def _call(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


async def _expired_turn(backend: Any, mode: str, conversation: str) -> tuple[Any, Any]:
    """A facade on the backend, and a first turn of ``conversation`` whose reservation has timed out."""
    if mode == "sync":
        mem: Any = CpMemory(store=backend.make_sync(3600.0), config=CONFIG)
    else:
        mem = AsyncCpMemory(store=backend.make_async(3600.0), config=CONFIG)
    turn = await _call(mem.prepare(conversation, "When did the bridge open?", BLOCKS))
    backend.sleep(0.1 + backend.timing_slack_s)
    return mem, turn


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_late_commit_joins_the_history(backend: Any, mode: str) -> None:
    conversation = f"late-{mode}-{backend.name}"
    mem, first = await _expired_turn(backend, mode, conversation)
    assert await _call(mem.commit(first, "In 1932.", late=True)) == 1
    assert mem.counters.snapshot()["late_commits"] == 1

    second = await _call(mem.prepare(conversation, "How long is its span?", BLOCKS))
    contents = [message["content"] for message in second.messages]
    assert "In 1932." in contents  # the late answer is in the history the next turn sends
    assert {d.status.value for d in second.decisions} == {"referenced"}  # and its blocks count as shown
    assert await _call(mem.commit(second, "503 metres.")) == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_commit_without_late_still_refuses(backend: Any, mode: str) -> None:
    conversation = f"strict-{mode}-{backend.name}"
    mem, turn = await _expired_turn(backend, mode, conversation)
    with pytest.raises(ReservationExpiredError):
        await _call(mem.commit(turn, "In 1932."))
    later = await _call(mem.prepare(conversation, "When did the bridge open?", BLOCKS))
    assert later.turn == turn.turn and {d.status.value for d in later.decisions} == {"new"}  # nothing recorded
    assert mem.counters.snapshot()["late_commits"] == 0
