"""Faults with real processes on loopback: an engine replica killed mid-run, the proxy restarted with Redis state."""
from __future__ import annotations

import asyncio
import os
import uuid

import httpx
import pytest

from cpmemory.bench.load import RecordingTransport
from cpmemory.core.invariants import check_no_loss
from cpmemory.routing.transport import HttpxChatTransport
from cpmemory.server.app import ServerConfig, create_app
from tests.e2e.conftest import PROXY_SETTINGS

DOCS = [{"id": f"d{i}", "text": f"Doc {i} says: " + f"point {i} of the matter. " * 12} for i in range(20)]


def blocks_for(conversation: int, turn: int) -> list[dict]:
    # consecutive turns share two blocks, so de-duplication is exercised across the fault
    start = conversation % 4 + 2 * turn
    return DOCS[start:start + 4]


def body(conversation: str, turn: int, blocks: list[dict]) -> dict:
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f"question {turn}"}],
            "cpmemory": {"conversation_id": conversation, "blocks": blocks}}


async def _turn(client, recording, number: int, turn: int) -> dict:
    blocks = blocks_for(number, turn)
    response = await client.post("/v1/chat/completions", json=body(f"conv-{number}", turn, blocks))
    assert response.status_code == 200, response.text
    info = response.json()["cpmemory"]
    report = check_no_loss(blocks, recording.sent[info["request_id"]])
    assert report.ok, report.violations
    return info


async def test_engine_replica_killed_mid_run_fails_over_and_loses_nothing(processes) -> None:
    engines = [processes.engine().start(), processes.engine().start()]
    recording = RecordingTransport(HttpxChatTransport())
    app = create_app(ServerConfig(engines=[e.url for e in engines], engine_timeout_s=5), transport=recording)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=30)
    router = app.state.service.dispatcher.router
    conversations = range(10)
    try:
        homes = {}
        for turn in (1, 2):
            infos = await asyncio.gather(*(_turn(client, recording, n, turn) for n in conversations))
            for n, info in zip(conversations, infos):
                assert homes.setdefault(n, info["replica"]) == info["replica"]  # turns stick to one replica
        assert set(homes.values()) == {0, 1}

        async def kill_soon() -> None:
            await asyncio.sleep(0.01)
            engines[0].stop()

        results = await asyncio.gather(kill_soon(), *(_turn(client, recording, n, 3) for n in conversations))
        for n, info in zip(conversations, results[1:]):
            if homes[n] == 1:
                assert info["replica"] == 1 and info["route_reason"] == "affinity"
            assert info["turn"] == 3
            assert "referenced" in {d["status"] for d in info["decisions"]}  # dedup survived the failover
        after = await asyncio.gather(*(_turn(client, recording, n, 4) for n in conversations))
        assert {info["replica"] for info in after} == {1}
        assert not router.status()[0].healthy

        engines[0].start()  # the replica comes back on its port; a probe puts it back into rotation
        assert await router.probe(recording.is_healthy) == [engines[0].url]
        assert router.status()[0].healthy
        back = await asyncio.gather(*(_turn(client, recording, n, 5) for n in conversations))
        # each conversation stays where its latest turns (its cached history) are
        assert [(info["replica"], info["route_reason"]) for info in back] == [(1, "affinity")] * len(back)
    finally:
        await client.aclose()
        await recording.aclose()


@pytest.mark.redis
def test_proxy_restarted_mid_conversation_continues_from_redis(processes, tmp_path) -> None:
    redis = pytest.importorskip("redis")
    url = os.environ.get("CPM_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url).ping()
    except redis.RedisError:
        pytest.skip("no Redis")
    prefix = f"cpmtest-{uuid.uuid4().hex[:12]}"
    engine = processes.engine().start()
    settings = tmp_path / "proxy.toml"  # the e2e settings plus this run's key prefix (the last --config is used)
    settings.write_text(PROXY_SETTINGS.read_text(encoding="utf-8") + f'\n[redis]\nprefix = "{prefix}"\n', encoding="utf-8")
    proxy = processes.proxy([engine.url], "--redis", url, "--config", str(settings)).start()
    try:
        first = httpx.post(proxy.url + "/v1/chat/completions", json=body("restart", 1, DOCS[:4]), timeout=30)
        assert first.status_code == 200, first.text
        proxy.stop()
        proxy.start()  # same port, same prefix: a fresh process with no memory of its own
        second = httpx.post(proxy.url + "/v1/chat/completions", json=body("restart", 2, DOCS[2:6]), timeout=30)
        assert second.status_code == 200, second.text
        info = second.json()["cpmemory"]
        assert info["turn"] == 2 and not info["degraded"]
        statuses = {d["block_id"]: d["status"] for d in info["decisions"]}
        assert statuses == {"d2": "referenced", "d3": "referenced", "d4": "new", "d5": "new"}
        sent = {r["request_id"]: r["messages"] for r in httpx.get(engine.url + "/_mock/requests").json()}
        messages = sent[info["request_id"]]
        assert check_no_loss(DOCS[2:6], messages).ok
        assert any(m["role"] == "assistant" for m in messages)  # turn 1 came back from Redis
    finally:
        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
