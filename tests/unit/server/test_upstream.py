"""`--upstream`: one gateway picks the replica; the proxy still prepares, commits and aborts."""
from __future__ import annotations

import httpx
import pytest

from cpmemory.routing.prefix import SentPrefixView
from cpmemory.routing.transport import HttpxChatTransport
from cpmemory.server.app import ServerConfig, create_app
from cpmemory.testing.mock_engine import MockEngine

BLOCKS = [{"id": f"doc-{i}", "text": f"Document {i}: " + "a fact about the topic. " * 20} for i in range(3)]


def turn(conversation: str, question: str) -> dict:
    return {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": question}],
            "cpmemory": {"conversation_id": conversation, "blocks": BLOCKS}}


@pytest.fixture
async def gateway_proxy():
    gateway = MockEngine(block_size=16, capacity_blocks=4096)
    transport = HttpxChatTransport(httpx.AsyncClient(transport=gateway.transport()))
    app = create_app(ServerConfig(upstream="http://gateway:18120"), transport=transport)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")
    yield gateway, app, client
    await client.aclose()
    await transport.aclose()


async def test_turns_go_to_the_gateway_and_are_committed(gateway_proxy) -> None:
    gateway, app, client = gateway_proxy
    first = await client.post("/v1/chat/completions", json=turn("c", "q1"))
    second = await client.post("/v1/chat/completions", json=turn("c", "q2"))
    assert first.status_code == second.status_code == 200
    assert second.json()["cpmemory"]["turn"] == 2
    assert {d["status"] for d in second.json()["cpmemory"]["decisions"]} == {"referenced"}
    assert len(gateway.requests) == 2 and app.state.service.dispatcher.router.view is None
    assert gateway.requests[1]["body"]["cache_salt"]  # the tenant's salt still goes with every request


async def test_gateway_down_is_an_engine_error_the_turn_is_aborted_and_nothing_is_lost(gateway_proxy) -> None:
    gateway, app, client = gateway_proxy
    assert (await client.post("/v1/chat/completions", json=turn("c", "q1"))).status_code == 200
    gateway.down = True
    failed = await client.post("/v1/chat/completions", json=turn("c", "q2"))
    assert failed.status_code == 502 and failed.json()["error"]["type"] == "engine_error"
    gateway.down = False  # back at once: the proxy never marked its only target down
    after = await client.post("/v1/chat/completions", json=turn("c", "q3"))
    assert after.status_code == 200 and after.json()["cpmemory"]["turn"] == 2  # the failed turn left no trace
    assert app.state.service.dispatcher.router.healthy_count() == 1


async def test_gateway_error_status_reaches_the_client_as_the_engines_would(gateway_proxy) -> None:
    gateway, _, client = gateway_proxy
    assert (await client.post("/v1/chat/completions", json=turn("warm", "q0"))).status_code == 200  # budget known
    gateway.fail_next(1, status=400)
    rejected = await client.post("/v1/chat/completions", json=turn("c", "q1"))
    assert rejected.status_code == 400 and rejected.json()["error"]["message"] == "injected failure"
    gateway.fail_next(1, status=503)
    unavailable = await client.post("/v1/chat/completions", json=turn("c", "q1"))
    assert unavailable.status_code == 502
    assert (await client.post("/v1/chat/completions", json=turn("c", "q1"))).json()["cpmemory"]["turn"] == 1


def test_config_needs_a_target_and_matching_kv_events() -> None:
    with pytest.raises(ValueError):
        ServerConfig()
    with pytest.raises(ValueError):
        ServerConfig(upstream="http://g", engines=["http://e"], kv_events=["tcp://a:1", "tcp://b:2"])
    config = ServerConfig(engines=["http://a", "http://b"])
    app = create_app(config)
    assert isinstance(app.state.service.dispatcher.router.view, SentPrefixView)


def test_behind_a_gateway_a_prompt_is_registered_with_every_replicas_sync() -> None:
    from cpmemory.engines.block_hashes import BlockHasher
    from cpmemory.engines.eviction_sync import EvictionSync
    from cpmemory.server.kv_sync import KVSyncHub, _Replica

    class Index:
        def __init__(self) -> None:
            self.evicted: list[str] = []

        def evict(self, request_ids, *, tenant="default") -> int:
            self.evicted.extend(request_ids)
            return len(request_ids)

        def reset_index(self, tenant=None) -> None:
            return None

    index = Index()
    hub = KVSyncHub(memory=None, engines=["http://a", "http://b"], endpoints=["tcp://a:1", "tcp://b:2"])
    syncs = [EvictionSync(index, BlockHasher(16)) for _ in range(2)]
    for position, sync in enumerate(syncs):
        hub._replicas[position] = _Replica(f"http://{'ab'[position]}", sync, None, None)
    hub.register_hashes(None, "req-1", (11, 12), "t")
    assert [sync.requests_for(12) for sync in syncs] == [{"req-1"}, {"req-1"}]
    hub.register_hashes(1, "req-2", (21,), "t")
    assert syncs[0].requests_for(21) == set() and syncs[1].requests_for(21) == {"req-2"}
    from cpmemory.engines.kv_events import BlockRemoved, EventBatch

    syncs[1].handle_batch(EventBatch(1, 0.0, (BlockRemoved((12,)),)))  # either replica dropping a block evicts
    assert index.evicted == ["req-1"]


async def test_upstream_session_names_each_conversation_to_the_gateway_and_nothing_else() -> None:
    """``--upstream-session``: a turn (streamed or not) carries ``session_params.session_id``, the same for every
    turn of a conversation and different between conversations, opaque (no conversation id in it); off, none."""
    for named in (True, False):
        gateway = MockEngine(block_size=16, capacity_blocks=4096)
        transport = HttpxChatTransport(httpx.AsyncClient(transport=gateway.transport()))
        app = create_app(ServerConfig(upstream="http://gateway:18120", upstream_session=named), transport=transport)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            for conversation, question, stream in (("conv-a", "q1", False), ("conv-b", "q1", False),
                                                   ("conv-a", "q2", True)):
                response = await client.post("/v1/chat/completions",
                                             json={**turn(conversation, question), "stream": stream})
                assert response.status_code == 200
        await transport.aclose()
        sessions = [record["body"].get("session_params") for record in gateway.requests]
        if not named:
            assert sessions == [None, None, None]
            continue
        ids = [session["session_id"] for session in sessions]
        assert ids[0] == ids[2] != ids[1] and all("conv" not in value for value in ids)
    with pytest.raises(ValueError, match="needs an upstream"):
        ServerConfig(engines=["http://e"], upstream_session=True)


@pytest.mark.parametrize("kv_events, warned", [(None, True), (["tcp://e0:5557", "tcp://e1:5557"], False)])
def test_behind_a_gateway_without_the_replicas_kv_events_the_proxy_warns_at_start(caplog, kv_events, warned) -> None:
    """Without the replicas' KV events the proxy cannot tell which replica served a turn (admission counts one pool
    for the fleet): MT-RAG through vllm-router fell from 1.78-2.46x to 1.14-1.36x. A user should hear it at start."""
    engines = ["http://e0:8000", "http://e1:8000"]
    with caplog.at_level("WARNING", logger="cpmemory.server.app"):
        create_app(ServerConfig(upstream="http://gateway:8000", engines=engines, kv_events=kv_events or []))
    assert any("--kv-events" in record.getMessage() for record in caplog.records) is warned
