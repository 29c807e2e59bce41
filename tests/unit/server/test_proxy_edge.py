"""The proxy's edge over ASGI, in front of in-process mock engines: liveness and readiness, the engines' model list
relayed, the request body limit, a ``max_tokens`` that fills the context, streamed turns in the metrics, and the
engine limits cached per served model (not per client-chosen name)."""
from __future__ import annotations

import httpx

from cpmemory.engines.client import AsyncEngineClient
from cpmemory.server.budget import EngineBudget
from cpmemory.testing.mock_engine import MockEngine

BLOCKS = [{"id": f"doc-{i}", "text": f"Document {i}: " + f"fact {i} about the topic. " * 20} for i in range(3)]


def turn(conversation: str, question: str, *, stream: bool = False, **fields: object) -> dict:
    return {"model": "tiny", "stream": stream, "messages": [{"role": "user", "content": question}],
            "cpmemory": {"conversation_id": conversation, "blocks": BLOCKS}, **fields}


def metric_values(text: str) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def test_liveness_answers_and_readiness_follows_the_engines(proxy) -> None:
    assert (await proxy.client.get("/livez")).json() == {"status": "ok"}
    ready = await proxy.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["engines_reachable"] == 2 and ready.json()["store"] == "ok"
    for url in proxy.fleet.urls:
        proxy.fleet.set_down(url)
    # the router has not marked them down (no call failed yet): readiness asks the engines themselves
    assert (await proxy.client.get("/healthz")).status_code == 200
    down = await proxy.client.get("/readyz")
    assert down.status_code == 503 and down.json()["engines_reachable"] == 0 and not down.json()["ready"]
    assert (await proxy.client.get("/livez")).status_code == 200
    proxy.fleet.set_down(proxy.fleet.urls[1], down=False)
    assert (await proxy.client.get("/readyz")).json()["engines_reachable"] == 1


async def test_readiness_fails_while_the_store_cannot_be_reached(make_proxy) -> None:
    from cpmemory.facade import AsyncCpMemory
    from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisStoreConfig

    dead = AsyncRedisSessionStore.from_url("redis://127.0.0.1:1/0", RedisStoreConfig(prefix="cpmdead"))
    proxy = make_proxy(memory=AsyncCpMemory(store=dead))
    answer = await proxy.client.get("/readyz")
    assert answer.status_code == 503 and answer.json()["engines_reachable"] == 2
    assert answer.json()["store"].startswith("unavailable")


async def test_the_engines_model_list_is_relayed_and_needs_the_api_key(make_proxy) -> None:
    proxy = make_proxy(api_keys={"key-a": "a"}, cache_salt_secret="s" * 16)
    assert (await proxy.client.get("/v1/models")).status_code == 401
    listed = await proxy.client.get("/v1/models", headers={"Authorization": "Bearer key-a"})
    assert listed.status_code == 200 and [entry["id"] for entry in listed.json()["data"]] == ["tiny"]
    proxy.fleet.set_down(proxy.fleet.urls[0])
    failed_over = await proxy.client.get("/v1/models", headers={"Authorization": "Bearer key-a"})
    assert failed_over.status_code == 200 and failed_over.json()["data"][0]["id"] == "tiny"
    proxy.fleet.set_down(proxy.fleet.urls[1])
    none = await proxy.client.get("/v1/models", headers={"Authorization": "Bearer key-a"})
    assert none.status_code == 502 and none.json()["error"]["code"] == "engine_failed"


async def test_a_body_over_the_limit_gets_413_and_nothing_reaches_the_engines(make_proxy) -> None:
    proxy = make_proxy(max_body_bytes=64 * 1024)
    big = turn("big", "q" * (80 * 1024))
    declared = await proxy.client.post("/v1/chat/completions", json=big)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    async def chunks():  # no Content-Length: the limit applies as the body is read
        payload = httpx.Request("POST", "http://x", json=big).content
        for start in range(0, len(payload), 8192):
            yield payload[start:start + 8192]

    chunked = await proxy.client.post("/v1/chat/completions", content=chunks(),
                                      headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "max_body_bytes" in chunked.json()["error"]["message"]
    assert not proxy.fleet.calls
    small = await proxy.client.post("/v1/chat/completions", json=turn("small", "q"))
    assert small.status_code == 200, small.text


async def test_max_tokens_that_fills_the_context_is_a_400_naming_it(make_proxy) -> None:
    proxy = make_proxy(engine_count=1)
    proxy.engines[0].max_model_len = 4096
    for field in ("max_tokens", "max_completion_tokens"):
        rejected = await proxy.client.post("/v1/chat/completions", json=turn("m", "q", **{field: 4096}))
        error = rejected.json()["error"]
        assert rejected.status_code == 400 and error["param"] == field and field in error["message"]
        assert "block" not in error["message"]
    assert not proxy.fleet.calls
    # below the context but leaving a block no room: the error says the budget is what max_tokens left
    crowded = await proxy.client.post("/v1/chat/completions", json=turn("m", "q", max_tokens=4000))
    error = crowded.json()["error"]
    assert crowded.status_code == 400 and error["param"] == "max_tokens" and "max_tokens (4000)" in error["message"]
    assert not proxy.fleet.calls
    fits = await proxy.client.post("/v1/chat/completions", json=turn("m", "q", max_tokens=512))
    assert fits.status_code == 200 and fits.json()["cpmemory"]["turn"] == 1


async def test_streamed_turns_are_counted_like_whole_ones(make_proxy) -> None:
    counted = {}
    for stream in (False, True):
        proxy = make_proxy(engine_count=1)
        for question in ("q1", "q2"):
            answer = await proxy.client.post("/v1/chat/completions", json=turn("s", question, stream=stream))
            assert answer.status_code == 200
            await answer.aread()
        counted[stream] = metric_values((await proxy.client.get("/metrics")).text)
    for name in ("cpmemory_tokens_deduplicated_total", 'cpmemory_blocks_total{status="new"}',
                 'cpmemory_blocks_total{status="referenced"}'):
        assert counted[True][name] == counted[False][name] > 0, name


def counting_transport(engine: MockEngine, calls: list[str]) -> httpx.MockTransport:
    """The mock engine's own HTTP handler, with every request's path written down as it arrives."""

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return engine.handle(request)

    return httpx.MockTransport(handle)


async def test_two_hundred_model_names_cost_no_engine_call_and_no_entry_each() -> None:
    engine = MockEngine(max_model_len=4096, model="served")
    calls: list[str] = []
    now = [0.0]
    async with AsyncEngineClient("http://engine", transport=counting_transport(engine, calls)) as client:
        budget = EngineBudget(client, clock=lambda: now[0])
        for number in range(200):
            limits = await budget.limits(f"client-name-{number}")
            assert limits.max_model_len == 4096 and limits.tokenize
            budget.observe(f"client-name-{number}", 1000, 1100)
        assert calls.count("/v1/models") == 1 and calls.count("/tokenize") == 1
        assert budget.served_model("anything") == "served" and budget.planning_budget("x", 1000) < 1000
        now[0] += 3600.0  # an unknown name asks the list again, once per retry window whatever the names
        for number in range(200, 400):
            await budget.limits(f"client-name-{number}")
        assert calls.count("/v1/models") == 2 and calls.count("/tokenize") == 1
        assert len(budget._limits) == 1 and len(budget._ratio) == 1 and not budget._checking


async def test_a_model_the_engine_starts_listing_later_gets_its_own_limits() -> None:
    engine = MockEngine(max_model_len=2048, model="base")
    calls: list[str] = []
    now = [0.0]
    async with AsyncEngineClient("http://engine", transport=counting_transport(engine, calls)) as client:
        budget = EngineBudget(client, clock=lambda: now[0])
        assert (await budget.limits("base")).max_model_len == 2048
        engine.model, engine.max_model_len = "adapter", 1024  # the engine now lists another model
        assert (await budget.limits("adapter")).max_model_len == 2048  # not listed when asked: the base's
        now[0] += 3600.0
        assert (await budget.limits("adapter")).max_model_len == 1024
        assert calls.count("/v1/models") == 2
