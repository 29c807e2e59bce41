"""End to end through the facade on the real Redis: two facade instances ("workers") serve one conversation."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cpmemory.core.invariants import check_no_loss
from cpmemory.facade import AsyncCpMemory, CpMemory
from cpmemory.session.config import CpMemoryConfig
from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisSessionStore, RedisStoreConfig

pytestmark = pytest.mark.redis

DOCS = [{"id": f"doc-{i}", "text": f"Passage {i}: " + f"detail {i} of the report; " * 10} for i in range(10)]


def _statuses(turn) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {decision.block_id: decision.status for decision in turn.decisions}


@pytest.fixture
def config(run_prefix: str) -> RedisStoreConfig:
    return RedisStoreConfig(prefix=run_prefix, socket_timeout_s=5.0)


def test_two_workers_share_one_conversation(real_redis: str, config: RedisStoreConfig) -> None:
    worker_a = CpMemory(store=RedisSessionStore.from_url(real_redis, config))
    worker_b = CpMemory(store=RedisSessionStore.from_url(real_redis, config))
    conversation = f"conv-{uuid.uuid4().hex}"
    turns = [
        (worker_a, DOCS[0:5]),
        (worker_b, DOCS[2:7]),
        (worker_a, DOCS[5:9]),
        (worker_b, DOCS[0:3] + DOCS[8:10]),
    ]
    shown: set[str] = set()
    for number, (worker, docs) in enumerate(turns, start=1):
        turn = worker.prepare(conversation, f"question {number}", docs)
        report = check_no_loss(docs, turn.messages)
        assert report.ok, report.violations
        for doc in docs:  # referenced exactly when an earlier committed turn (on either worker) showed it
            assert _statuses(turn)[doc["id"]] == ("referenced" if doc["id"] in shown else "new")
        assert worker.commit(turn, f"answer {number}") == number
        shown |= {doc["id"] for doc in docs}


def test_concurrent_turns_do_not_reference_uncommitted_blocks(
    real_redis: str, config: RedisStoreConfig
) -> None:
    worker_a = CpMemory(store=RedisSessionStore.from_url(real_redis, config))
    worker_b = CpMemory(store=RedisSessionStore.from_url(real_redis, config))
    conversation = f"conv-{uuid.uuid4().hex}"
    first = worker_a.prepare(conversation, "q1", DOCS[:4])
    second = worker_b.prepare(conversation, "q2", DOCS[:4])  # before the first commits
    assert set(_statuses(second).values()) == {"new"}
    worker_a.commit(first, "a1")
    worker_b.abort(second)  # its LLM call failed
    third = worker_b.prepare(conversation, "q3", DOCS[:4])
    assert set(_statuses(third).values()) == {"referenced"}  # only the committed turn counts
    assert check_no_loss(DOCS[:4], third.messages).ok


def test_async_facade_on_redis(real_redis: str, config: RedisStoreConfig) -> None:
    async def scenario() -> list[dict[str, str]]:
        store = AsyncRedisSessionStore.from_url(real_redis, config)
        memory = AsyncCpMemory(store=store)
        conversation = f"conv-{uuid.uuid4().hex}"
        first = await memory.prepare(conversation, "q1", DOCS[:5])
        await memory.commit(first, "a1")
        second = await memory.prepare(conversation, "q2", DOCS[3:8])
        assert check_no_loss(DOCS[3:8], second.messages).ok
        await memory.commit(second, "a2")
        await store.close()
        return [_statuses(first), _statuses(second)]

    first, second = asyncio.run(scenario())
    assert set(first.values()) == {"new"}
    assert second == {
        "doc-3": "referenced",
        "doc-4": "referenced",
        "doc-5": "new",
        "doc-6": "new",
        "doc-7": "new",
    }


def test_history_window_on_redis_resends_blocks_of_dropped_turns(
    real_redis: str, config: RedisStoreConfig
) -> None:

    mem = CpMemory(
        store=RedisSessionStore.from_url(real_redis, config), config=CpMemoryConfig(max_history_turns=2)
    )
    conversation = f"conv-{uuid.uuid4().hex}"
    last_full: dict[str, int] = {}
    for number in range(1, 7):
        docs = [
            DOCS[0],
            DOCS[number],
        ]  # DOCS[0] every turn: referenced while its last full copy is in the window
        turn = mem.prepare(conversation, f"question {number}", docs)
        assert check_no_loss(docs, turn.messages).ok
        assert len(turn.messages) <= 2 * 2 + 2
        last = last_full.get("doc-0")
        expected = "new" if last is None else ("referenced" if last > turn.dropped_turns else "resent")
        assert _statuses(turn)["doc-0"] == expected
        if expected != "referenced":
            last_full["doc-0"] = number
        assert mem.commit(turn, f"answer {number}") == number


def test_budget_on_redis_keeps_only_the_window_and_every_prompt_fits(
    real_redis: str, config: RedisStoreConfig
) -> None:
    import random

    from cpmemory.core.invariants import check_no_loss
    from cpmemory.session.budget import estimate_tokens

    mem = CpMemory(store=RedisSessionStore.from_url(real_redis, config), config=CpMemoryConfig(max_prompt_tokens=1500))
    rng = random.Random(7)
    docs = [" ".join(rng.choice(["amber", "basalt", "cobalt", "dune", "ember"]) for _ in range(50)) for _ in range(20)]
    conversation = f"budget-{rng.random()}"
    for turn in range(40):
        blocks = [{"id": f"d{i}", "text": docs[i]} for i in rng.sample(range(20), 3)]
        prepared = mem.prepare(conversation, f"q{turn}", blocks)
        assert sum(estimate_tokens(m["content"]) + 8 for m in prepared.messages) <= 1500
        assert check_no_loss(blocks, prepared.messages).ok
        mem.commit(prepared, "answer " * 30)
        state = mem.state(conversation)
        stored_turns = len(state.search_paths)
        assert stored_turns == len(state.transcript) // 2 == state.turns - prepared.dropped_turns
        assert all(seen.turn > prepared.dropped_turns for seen in state.seen.values())
    assert prepared.dropped_turns > 20  # the window restarted many times; the store kept only the window


async def test_async_facade_with_a_budget_on_redis(real_redis: str, config: RedisStoreConfig) -> None:
    from cpmemory.errors import PromptBudgetError

    store = AsyncRedisSessionStore.from_url(real_redis, config)
    mem = AsyncCpMemory(store=store, config=CpMemoryConfig(max_prompt_tokens=400))
    for turn in range(10):
        prepared = await mem.prepare("async-budget", f"q{turn}", [{"id": f"b{turn % 3}", "text": "text " * 40}])
        assert prepared.prompt_tokens <= 400 and prepared.budget == 400
        await mem.commit(prepared, "answer " * 20)
    with pytest.raises(PromptBudgetError):
        await mem.prepare("async-budget", "q", [{"id": "huge", "text": "text " * 500}])
    assert (await mem.state("async-budget")).open_reservations == 0
    await store.close()
