"""A store outage never makes the model forget: a ten-turn conversation through the proxy on its own redis-server,
stopped for three turns and restarted (empty: the throw-away server persists nothing). Every turn's prompt carries
the whole conversation before it, the turn counter goes on, and afterwards the store's transcript has all ten turns
(the turns kept during the outage, and those the restarted server lost, are written back at the next turn)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from cpmemory.core.invariants import check_no_loss
from cpmemory.facade import AsyncCpMemory
from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisStoreConfig
from cpmemory.testing.local_redis import LocalRedisServer, redis_binaries_available
from tests.unit.server.conftest import Proxy

pytestmark = [pytest.mark.redis,
              pytest.mark.skipif(not redis_binaries_available(), reason="redis-server / redis-cli not on PATH")]

DOCS = [{"id": f"doc-{i}", "text": f"Document {i}. " + f"fact {i} about the harbor; " * 12} for i in range(8)]
OUTAGE = (4, 5, 6)


def answer_of(body: Mapping[str, Any]) -> str:
    """The mock engine's answer: names the question, so each turn's answer is its own."""
    return "answer to " + str(body["messages"][-1]["content"]).rsplit("Question: ", 1)[-1]


@pytest.mark.parametrize("resend", [False, True], ids=["new-message-only", "whole-history"])
async def test_ten_turns_with_redis_stopped_for_three_keep_every_turn(resend: bool) -> None:
    config = RedisStoreConfig(prefix="outage", socket_timeout_s=0.2, connect_timeout_s=0.2, retries=0)
    with LocalRedisServer() as server:
        store = AsyncRedisSessionStore.from_url(server.url, config)
        memory = AsyncCpMemory(store=store)
        proxy = Proxy(engine_count=1, memory=memory)
        proxy.engines[0].reply = answer_of
        history: list[dict[str, str]] = []
        answers: list[str] = []
        try:
            for number in range(1, 11):
                if number == OUTAGE[0]:
                    server.stop()
                if number == OUTAGE[-1] + 1:
                    server.start()  # same port, empty
                question = f"q{number}"
                blocks = DOCS[number % 5 : number % 5 + 3]
                messages = [{"role": "system", "content": "Be brief."}, *(history if resend else []),
                            {"role": "user", "content": question}]
                response = await proxy.client.post("/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 8, "messages": messages,
                    "cpmemory": {"conversation_id": "long", "blocks": blocks}})
                assert response.status_code == 200, response.text
                info = response.json()["cpmemory"]
                sent = proxy.engines[0].requests[-1]["body"]["messages"]
                assert info["turn"] == number
                assert info["degraded"] == (number in OUTAGE) and info["kept_locally"] == (number in OUTAGE)
                assert [m["content"] for m in sent if m["role"] == "assistant"] == answers  # the whole history
                assert sum(m["role"] == "user" for m in sent) == number and check_no_loss(blocks, sent).ok
                assert info["history"] == ("matched" if resend and number > 1 else "none")
                answer = response.json()["choices"][0]["message"]["content"]
                answers.append(answer)
                history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            state = await memory.state("long")
            assert state.turns == 10
            assert [m["content"] for m in state.transcript if m["role"] == "assistant"] == answers
            counters = memory.counters.snapshot()
            assert counters["local_commits"] == len(OUTAGE) and counters["local_commits_lost"] == 0
        finally:
            await proxy.aclose()
            await store.close()
