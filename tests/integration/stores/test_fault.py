"""Outage: a conversation through the facade on its own redis-server, killed (-9) mid-conversation, restarted.

While Redis is down every prepare is a pass-through (degraded, relevance order, every block in full, no loss),
logged once and counted, with the conversation's history from the facade's local copy; commits made meanwhile (and
the commit of a turn prepared before the kill) are kept. After the restart on the same port the store recovers by
itself (reconnect, scripts reloaded on NOSCRIPT): the next turn writes back the turns the empty server lost and
those kept, and de-duplication resumes against the blocks shown in them.
"""
from __future__ import annotations

import asyncio
import logging

import pytest

from cpmemory.core.invariants import check_no_loss
from cpmemory.facade import AsyncCpMemory, CpMemory
from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisSessionStore, RedisStoreConfig
from cpmemory.testing.local_redis import LocalRedisServer, redis_binaries_available

pytestmark = pytest.mark.skipif(not redis_binaries_available(), reason="redis-server / redis-cli not on PATH")

DOCS = [{"id": f"doc-{i}", "text": f"Document {i}. " + f"fact {i} about the topic; " * 12} for i in range(12)]


def _statuses(turn) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {decision.block_id: decision.status for decision in turn.decisions}


def _assert_complete(blocks: list[dict[str, str]], turn) -> None:  # type: ignore[no-untyped-def]
    report = check_no_loss(blocks, turn.messages)
    assert report.ok, report.violations


def test_kill_restart_passes_through_then_resumes(caplog: pytest.LogCaptureFixture) -> None:
    config = RedisStoreConfig(prefix="fault", socket_timeout_s=0.2, connect_timeout_s=0.2, retries=0)
    with LocalRedisServer() as server:
        memory = CpMemory(store=RedisSessionStore.from_url(server.url, config))
        first = memory.prepare("conv", "q1", DOCS[:6])
        assert memory.commit(first, "a1") == 1
        second = memory.prepare("conv", "q2", DOCS[3:9])
        assert {_statuses(second)[f"doc-{i}"] for i in (3, 4, 5)} == {"referenced"}
        _assert_complete(DOCS[3:9], second)

        server.kill()  # crash between prepare and commit
        assert memory.commit(second, "a2") == 2  # kept, to be written back
        caplog.set_level(logging.WARNING, logger="cpmemory.session.lifecycle")
        for number in (3, 4):
            turn = memory.prepare("conv", f"q{number}", DOCS[2:10])
            assert turn.degraded and turn.turn == number and set(_statuses(turn).values()) == {"new"}
            assert all(doc["text"] in turn.messages[-1]["content"] for doc in DOCS[2:10])
            assert [m["content"] for m in turn.messages if m["role"] == "assistant"] == ["a1", "a2", "a3"][: number - 1]
            _assert_complete(DOCS[2:10], turn)
            assert memory.commit(turn, f"a{number}") == number
        assert memory.counters.snapshot()["fallbacks"] == 2
        assert sum("unavailable" in record.getMessage() for record in caplog.records) == 1  # logged once

        server.start()  # same port, empty state, empty script cache
        fifth = memory.prepare("conv", "q5", DOCS[:6])
        assert not fifth.degraded and fifth.turn == 5
        statuses = _statuses(fifth)  # blocks seen only in the rewritten turn 1 are not referred to as a whole
        assert statuses["doc-0"] != "referenced" and statuses["doc-1"] != "referenced"
        assert [statuses[f"doc-{i}"] for i in range(2, 6)] == ["referenced"] * 4  # shown in the kept turns
        _assert_complete(DOCS[:6], fifth)
        assert memory.commit(fifth, "a5") == 5
        transcript = memory.state("conv").transcript
        assert [m["content"] for m in transcript if m["role"] == "assistant"] == ["a1", "a2", "a3", "a4", "a5"]


def test_kill_restart_async_store() -> None:
    config = RedisStoreConfig(prefix="fault-async", socket_timeout_s=0.2, connect_timeout_s=0.2, retries=0)

    async def scenario(server: LocalRedisServer) -> None:
        store = AsyncRedisSessionStore.from_url(server.url, config)
        memory = AsyncCpMemory(store=store)
        first = await memory.prepare("conv", "q1", DOCS[:4])
        assert await memory.commit(first, "a1") == 1
        server.kill()
        during = await memory.prepare("conv", "q2", DOCS[:6])
        assert during.degraded and set(_statuses(during).values()) == {"new"}
        _assert_complete(DOCS[:6], during)
        server.start()
        after = await memory.prepare("conv", "q3", DOCS[:4])
        assert not after.degraded and set(_statuses(after).values()) == {"new"}  # the server kept nothing
        assert await memory.commit(after, "a3") == 1
        resumed = await memory.prepare("conv", "q4", DOCS[2:6])
        assert [_statuses(resumed)[f"doc-{i}"] for i in range(2, 6)] == ["referenced", "referenced", "new", "new"]
        _assert_complete(DOCS[2:6], resumed)
        await store.close()

    with LocalRedisServer() as server:
        asyncio.run(scenario(server))
