"""The proxy end to end over ASGI, in front of two in-process mock engines (real facade, in-memory store)."""
from __future__ import annotations

import json

import pytest

from cpmemory.core.invariants import check_no_loss

BLOCKS_1 = [{"id": f"doc-{i}", "text": f"Document {i}: " + f"fact {i} about the topic. " * 20} for i in range(4)]
BLOCKS_2 = [BLOCKS_1[2], {"id": "doc-9", "text": "Document 9: a new fact. " * 20}, BLOCKS_1[0]]


def turn_body(conversation: str, question: str, blocks: list[dict], stream: bool = False) -> dict:
    return {"model": "tiny", "stream": stream, "max_tokens": 8,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
            "cpmemory": {"conversation_id": conversation, "blocks": blocks}}


async def test_turns_dedup_commit_and_stick_to_one_replica(proxy) -> None:
    first = await proxy.client.post("/v1/chat/completions", json=turn_body("c1", "What is fact 1?", BLOCKS_1))
    assert first.status_code == 200, first.text
    info1 = first.json()["cpmemory"]
    assert info1["committed"] and {d["status"] for d in info1["decisions"]} == {"new"}
    engine = proxy.engine_of(first.json())
    sent1 = engine.requests[-1]["body"]
    assert sent1["request_id"] == info1["request_id"] and sent1["cache_salt"]
    assert "cpmemory" not in sent1 and check_no_loss(BLOCKS_1, sent1["messages"]).ok

    second = await proxy.client.post("/v1/chat/completions", json=turn_body("c1", "And fact 9?", BLOCKS_2))
    info2 = second.json()["cpmemory"]
    assert info2["replica"] == info1["replica"] and info2["route_reason"] == "affinity"
    statuses = {d["block_id"]: d["status"] for d in info2["decisions"]}
    assert statuses == {"doc-2": "referenced", "doc-9": "new", "doc-0": "referenced"}
    assert info2["tokens_deduplicated"] > 0
    sent2 = engine.requests[-1]["body"]["messages"]
    assert check_no_loss(BLOCKS_2, sent2).ok
    assert info2["cached_tokens"] > 0 and info2["cached_tokens"] == second.json()["usage"][
        "prompt_tokens_details"]["cached_tokens"]
    # the first turn's answer is part of the transcript sent with the second
    assert any(m["role"] == "assistant" for m in sent2)


async def test_header_names_the_conversation(proxy) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
    first = await proxy.client.post("/v1/chat/completions", json=body, headers={"X-Cpmemory-Conversation": "h"})
    second = await proxy.client.post("/v1/chat/completions", json=body, headers={"X-Cpmemory-Conversation": "h"})
    assert first.status_code == second.status_code == 200
    assert second.json()["cpmemory"]["turn"] == first.json()["cpmemory"]["turn"] + 1


async def test_plain_requests_pass_through_with_salt(proxy) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "plain"}], "temperature": 0.5,
            "cache_salt": "forged"}
    response = await proxy.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and "cpmemory" not in response.json()
    sent = [r["body"] for engine in proxy.engines for r in engine.requests][-1]
    assert sent["messages"] == body["messages"] and sent["temperature"] == 0.5
    assert sent["cache_salt"] == proxy.service.cache_salt("default") != "forged"


async def test_streaming_turn_relays_bytes_and_commits(proxy) -> None:
    response = await proxy.client.post("/v1/chat/completions", json=turn_body("s", "q?", BLOCKS_1, stream=True))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert b"data: [DONE]" in response.content
    replica = int(response.headers["x-cpmemory-replica"])
    again = await proxy.client.post("/v1/chat/completions", json=turn_body("s", "q2?", BLOCKS_1))
    info = again.json()["cpmemory"]
    assert info["replica"] == replica and info["turn"] == 2
    assert {d["status"] for d in info["decisions"]} == {"referenced"}


async def test_engine_failure_fails_over_then_aborts_when_all_down(proxy) -> None:
    first = await proxy.client.post("/v1/chat/completions", json=turn_body("f", "q1", BLOCKS_1))
    home = first.json()["cpmemory"]["replica"]
    proxy.engines[home].down = True
    moved = await proxy.client.post("/v1/chat/completions", json=turn_body("f", "q2", BLOCKS_2))
    info = moved.json()["cpmemory"]
    assert moved.status_code == 200 and info["replica"] != home and info["failovers"] == 1
    proxy.engines[1 - home].down = True
    failed = await proxy.client.post("/v1/chat/completions", json=turn_body("f", "q3", BLOCKS_1))
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "no_healthy_replica"
    for engine in proxy.engines:
        engine.down = False
    await proxy.service.dispatcher.router.probe(proxy.transport.is_healthy)
    after = await proxy.client.post("/v1/chat/completions", json=turn_body("f", "q4", BLOCKS_1))
    assert after.json()["cpmemory"]["turn"] == 3  # the failed turn was aborted, not committed
    # the conversation stays where its last committed turn (and so its history) is cached
    assert after.json()["cpmemory"]["replica"] == info["replica"]
    assert after.json()["cpmemory"]["route_reason"] == "affinity"


async def test_engine_client_error_is_relayed_and_turn_aborted(proxy) -> None:
    for engine in proxy.engines:
        engine.fail_next(1, status=400)
    bad = await proxy.client.post("/v1/chat/completions", json=turn_body("e", "q", BLOCKS_1))
    assert bad.status_code == 400
    for engine in proxy.engines:
        engine.fail_next(1, status=500)
    bad = await proxy.client.post("/v1/chat/completions", json=turn_body("e", "q", BLOCKS_1))
    assert bad.status_code == 502 and bad.json()["error"]["type"] == "engine_error"
    good = await proxy.client.post("/v1/chat/completions", json=turn_body("e", "q", BLOCKS_1))
    assert good.json()["cpmemory"]["turn"] == 1


@pytest.mark.parametrize("extension", [
    {"conversation_id": 5, "blocks": []},
    {"conversation_id": "", "blocks": []},
    {"conversation_id": "x", "blocks": [{"id": "a"}]},
    {"conversation_id": "x", "blocks": [{"id": None, "text": "t"}]},
    {"conversation_id": "x", "blocks": [{"id": "a", "text": "t", "extra": 1}]},
    {"conversation_id": "x", "blocks": "not a list"},
    {"conversation_id": "x", "unknown": True},
    {"conversation_id": "x", "blocks": [{"id": "a", "text": "\ud800"}]},
    "just a string",
])
async def test_malformed_extension_is_a_typed_4xx_and_changes_nothing(proxy, extension) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "cpmemory": extension}
    response = await proxy.client.post("/v1/chat/completions", content=json.dumps(body),
                                       headers={"content-type": "application/json"})
    assert response.status_code in (400, 422)
    assert set(response.json()["error"]) >= {"type", "code", "message"}
    assert all(not engine.requests for engine in proxy.engines)
    ok = await proxy.client.post("/v1/chat/completions", json=turn_body("x", "q", BLOCKS_1))
    assert ok.json()["cpmemory"]["turn"] == 1


async def test_missing_conversation_and_non_text_content_are_400(proxy) -> None:
    no_id = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "cpmemory": {"blocks": BLOCKS_1}}
    assert (await proxy.client.post("/v1/chat/completions", json=no_id)).status_code == 400
    image = turn_body("img", "q", BLOCKS_1)
    image["messages"][-1]["content"] = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    response = await proxy.client.post("/v1/chat/completions", json=image)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_input"
    assert (await proxy.client.post("/v1/chat/completions", content=b"{not json")).status_code == 422


async def test_metrics_and_healthz(proxy) -> None:
    await proxy.client.post("/v1/chat/completions", json=turn_body("m", "q1", BLOCKS_1))
    await proxy.client.post("/v1/chat/completions", json=turn_body("m", "q2", BLOCKS_1))
    text = (await proxy.client.get("/metrics")).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["cpmemory_engine_cached_tokens_total"] > 0
    assert values["cpmemory_tokens_deduplicated_total"] > 0
    assert values["cpmemory_middleware_overhead_seconds_count"] == 2
    assert sum(v for k, v in values.items() if k.startswith("cpmemory_requests_total")) == 2
    health = await proxy.client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    proxy.service.dispatcher.router.mark_down("http://engine-0")
    proxy.service.dispatcher.router.mark_down("http://engine-1")
    assert (await proxy.client.get("/healthz")).status_code == 503


async def test_eviction_report_removes_index_leaves(proxy) -> None:
    response = await proxy.client.post("/v1/chat/completions", json=turn_body("ev", "q", BLOCKS_1))
    request_id = response.json()["cpmemory"]["request_id"]
    memory = proxy.service.memory
    before = memory.index_size("default")
    report = await proxy.client.post("/v1/cpmemory/evictions", json={"request_ids": [request_id, "unknown"]})
    assert report.status_code == 200 and report.json() == {"evicted": 1}
    assert memory.index_size("default") == before - 1
    bad = await proxy.client.post("/v1/cpmemory/evictions", json={"request_ids": "x"})
    assert bad.status_code == 422


async def test_store_outage_degrades_to_pass_through_with_nothing_lost(make_proxy) -> None:
    from cpmemory.facade import AsyncCpMemory
    from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisStoreConfig

    dead = AsyncRedisSessionStore.from_url("redis://127.0.0.1:1/0", RedisStoreConfig(prefix="cpmdead"))
    proxy = make_proxy(memory=AsyncCpMemory(store=dead))
    response = await proxy.client.post("/v1/chat/completions", json=turn_body("d", "q", BLOCKS_1))
    assert response.status_code == 200
    info = response.json()["cpmemory"]
    assert info["degraded"] and not info["committed"]
    sent = proxy.engine_of(response.json()).requests[-1]["body"]["messages"]
    assert check_no_loss(BLOCKS_1, sent).ok
    text = (await proxy.client.get("/metrics")).text
    assert 'cpmemory_fallbacks_total{kind="store"} 1.0' in text
    await proxy.aclose()


async def test_hung_engine_times_out_and_fails_over(proxy) -> None:
    first = await proxy.client.post("/v1/chat/completions", json=turn_body("hang", "q1", BLOCKS_1))
    home = first.json()["cpmemory"]["replica"]
    proxy.engines[home].hang_next(1)
    second = await proxy.client.post("/v1/chat/completions", json=turn_body("hang", "q2", BLOCKS_1))
    info = second.json()["cpmemory"]
    assert second.status_code == 200 and info["replica"] != home and info["failovers"] == 1
    assert info["turn"] == 2 and {d["status"] for d in info["decisions"]} == {"referenced"}


async def test_stream_fails_over_before_the_first_byte_and_in_flight_returns_to_zero(proxy) -> None:
    first = await proxy.client.post("/v1/chat/completions", json=turn_body("sf", "q1", BLOCKS_1))
    home = first.json()["cpmemory"]["replica"]
    proxy.engines[home].down = True
    streamed = await proxy.client.post("/v1/chat/completions", json=turn_body("sf", "q2", BLOCKS_2, stream=True))
    assert streamed.status_code == 200 and int(streamed.headers["x-cpmemory-replica"]) != home
    assert b"data: [DONE]" in streamed.content
    plain = await proxy.client.post("/v1/chat/completions",
                                    json={"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    assert plain.status_code == 200 and b"[DONE]" in plain.content
    assert [status.in_flight for status in proxy.service.dispatcher.router.status()] == [0, 0]
    third = await proxy.client.post("/v1/chat/completions", json=turn_body("sf", "q3", BLOCKS_2))
    assert third.json()["cpmemory"]["turn"] == 3  # the streamed turn was committed


async def test_overloaded_replica_sheds_to_the_least_loaded(make_proxy) -> None:
    from cpmemory.routing.router import RouterConfig

    proxy = make_proxy(router=RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    first = await proxy.client.post("/v1/chat/completions", json=turn_body("busy", "q1", BLOCKS_1))
    home = first.json()["cpmemory"]["replica"]
    router = proxy.service.dispatcher.router
    for _ in range(3):  # three requests still in flight on the home replica
        router.begin(router.urls[home])
    shed = await proxy.client.post("/v1/chat/completions", json=turn_body("busy", "q2", BLOCKS_1))
    assert shed.json()["cpmemory"]["replica"] != home and shed.json()["cpmemory"]["route_reason"] == "load"
    assert 'cpmemory_fallbacks_total{kind="load"} 1.0' in (await proxy.client.get("/metrics")).text
    for _ in range(3):
        router.end(router.urls[home])
    back = await proxy.client.post("/v1/chat/completions", json=turn_body("busy", "q3", BLOCKS_1))
    # the conversation now follows the replica that holds its latest history (where turn 2 went)
    assert back.json()["cpmemory"]["replica"] == shed.json()["cpmemory"]["replica"]
    assert back.json()["cpmemory"]["route_reason"] == "affinity"


async def test_the_session_policy_places_new_conversations_by_load_and_keeps_their_turns(make_proxy) -> None:
    from cpmemory.routing.router import RouterConfig

    proxy = make_proxy(router=RouterConfig(policy="session"))
    router = proxy.service.dispatcher.router
    home = {}
    for conversation in ("a", "b", "c", "d"):
        reply = await proxy.client.post("/v1/chat/completions", json=turn_body(conversation, "q1", BLOCKS_1))
        home[conversation] = reply.json()["cpmemory"]["replica"]
        assert reply.json()["cpmemory"]["route_reason"] == "cold"
    assert sorted(home.values()) == [0, 0, 1, 1]  # by requests sent: a hash deals four ids 2:2 only by luck
    router.begin(router.urls[home["a"]])  # a's replica is now the busier: a's next turn still goes there
    for conversation in ("a", "b", "c", "d"):
        reply = await proxy.client.post("/v1/chat/completions", json=turn_body(conversation, "q2", BLOCKS_1))
        assert reply.json()["cpmemory"]["replica"] == home[conversation]
        assert reply.json()["cpmemory"]["route_reason"] == "affinity"
    router.end(router.urls[home["a"]])
    for engine in proxy.engines:
        assert all(check_no_loss(BLOCKS_1, request["body"]["messages"]).ok for request in engine.requests)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_slower_than_the_reservation_still_joins_the_history(make_proxy, stream: bool) -> None:
    """The engine takes longer than the facade's reservation timeout (a queued engine, a long answer, admission's
    wait): the proxy commits the turn late, so the next turn's prompt holds the answer and refers to its blocks."""
    from cpmemory import AsyncCpMemory, CpMemoryConfig

    proxy = make_proxy(1, memory=AsyncCpMemory(config=CpMemoryConfig(reservation_timeout_s=0.05)))
    proxy.engines[0].prefill_s_per_token = 0.15 / 400  # ~0.15 s for the first prompt's ~400 uncached tokens
    first = await proxy.client.post("/v1/chat/completions", json=turn_body("slow", "What is fact 1?", BLOCKS_1, stream))
    assert first.status_code == 200, first.text
    answer = proxy.engines[0].reply(proxy.engines[0].requests[-1]["body"])
    proxy.engines[0].prefill_s_per_token = 0.0
    second = await proxy.client.post("/v1/chat/completions", json=turn_body("slow", "And fact 9?", BLOCKS_2))
    info = second.json()["cpmemory"]
    assert {d["block_id"]: d["status"] for d in info["decisions"]}["doc-0"] == "referenced"
    assert {"role": "assistant", "content": answer} in proxy.engines[0].requests[-1]["body"]["messages"]
    metrics = (await proxy.client.get("/metrics")).text
    late = [line for line in metrics.splitlines() if line.startswith('cpmemory_memory_counter{counter="late_commits"}')]
    assert float(late[0].rsplit(" ", 1)[1]) >= 1  # the second turn may be late too on a loaded machine
