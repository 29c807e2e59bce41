"""The proxy's prefix-aware routing over mock engines: first turns find the replica holding their prefix."""
from __future__ import annotations

import asyncio

BLOCKS = [{"id": f"doc-{i}", "text": f"Document {i}: " + f"fact {i} about the topic. " * 30} for i in range(4)]


def first_turn(conversation: str) -> dict:
    return {"model": "tiny", "max_tokens": 8,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is it?"}],
            "cpmemory": {"conversation_id": conversation, "blocks": BLOCKS}}


def plain(prefix: str, question: str) -> dict:
    return {"model": "tiny", "max_tokens": 8,
            "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}]}


async def test_first_turns_sharing_blocks_go_where_they_are_cached(make_proxy) -> None:
    proxy = make_proxy(4)
    replicas, cached = set(), []
    for number in range(8):  # eight RAG requests, each its own conversation, same retrieved blocks
        info = (await proxy.client.post("/v1/chat/completions", json=first_turn(f"rag-{number}"))).json()["cpmemory"]
        replicas.add(info["replica"])
        cached.append(info["cached_tokens"])
    assert len(replicas) == 1  # rendezvous of eight conversation ids would have spread them over the replicas
    assert all(tokens > 0 for tokens in cached[1:])
    metrics = (await proxy.client.get("/metrics")).text
    assert 'cpmemory_route_decisions_total{reason="prefix",replica="' in metrics
    assert "cpmemory_route_cached_share_bucket" in metrics


async def test_plain_requests_with_different_prefixes_spread_and_same_prefixes_stick(make_proxy) -> None:
    proxy = make_proxy(4)
    homes: dict[int, set[int]] = {}
    for round_number in range(3):
        for family in range(8):
            body = plain(f"family {family} " + "shared instructions. " * 60, f"question {round_number}")
            before = [len(engine.requests) for engine in proxy.engines]
            response = await proxy.client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            served = [i for i, engine in enumerate(proxy.engines) if len(engine.requests) > before[i]]
            homes.setdefault(family, set()).update(served)
    assert all(len(replicas) == 1 for replicas in homes.values())
    assert len({next(iter(replicas)) for replicas in homes.values()}) >= 3  # families spread over the fleet


async def test_affinity_policy_routes_by_conversation(make_proxy) -> None:
    from cpmemory.routing.router import RouterConfig

    proxy = make_proxy(4, router=RouterConfig(policy="affinity"))
    replicas = set()
    for number in range(12):
        info = (await proxy.client.post("/v1/chat/completions", json=first_turn(f"rag-{number}"))).json()["cpmemory"]
        replicas.add(info["replica"])
        assert info["route_reason"] == "affinity"
    assert len(replicas) > 1


def synced_proxy(make_proxy, block_size: int, tokenizer=None):
    """Two mock replicas behind a proxy whose router scores them by an event view, with a KV-sync hub wired to both
    (no ZMQ: the subscribers are left out). Returns (proxy, hub, per-replica syncs, http client, the hosts that
    received a ``/tokenize``)."""
    import httpx

    from cpmemory.engines.block_hashes import BlockHasher
    from cpmemory.engines.client import AsyncEngineClient, EngineSettings
    from cpmemory.engines.eviction_sync import EvictionSync
    from cpmemory.routing.prefix import EventPrefixView
    from cpmemory.server.kv_sync import KVSyncHub, _Replica

    proxy = make_proxy(2)
    service, router = proxy.service, proxy.service.dispatcher.router
    router.view = EventPrefixView(2)
    fleet, tokenized = proxy.fleet.async_transport(), []

    class Counting(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/tokenize":
                tokenized.append(request.url.host)
            return await fleet.handle_async_request(request)

    http = httpx.AsyncClient(transport=Counting())
    hub = KVSyncHub(service.memory, proxy.fleet.urls, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], router.view,
                    tokenizer=tokenizer)
    hasher, syncs = BlockHasher(block_size), []
    for index, url in enumerate(proxy.fleet.urls):
        syncs.append(EvictionSync(service.memory.index_evictor(), hasher))
        hub._replicas[index] = _Replica(url, syncs[-1], None,
                                        AsyncEngineClient(EngineSettings(base_url=url), http=http))
    service.kv_sync = hub
    return proxy, hub, syncs, http, tokenized


async def test_a_kept_conversation_is_routed_without_a_tokenize_call_and_a_failed_one_moves_nothing(make_proxy) -> None:
    """With KV-event routing, the prompt's engine hashes cost a /tokenize before the request can leave; a later turn
    whose replica the router keeps needs none, and a tokenization that fails leaves the conversation where it is."""
    from cpmemory.routing.router import conversation_affinity_key

    proxy, _, _, http, tokenized = synced_proxy(make_proxy, 16)
    service, router = proxy.service, proxy.service.dispatcher.router
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "What is it? " * 20}]}
    key = next(conversation_affinity_key("default", f"c{n}") for n in range(50)
               if router.ranking(conversation_affinity_key("default", f"c{n}"))[0] == proxy.fleet.urls[0])
    try:
        first = await service.route_hint(payload, sticky=False, key=key)
        assert first.prompt is not None and len(tokenized) == 1  # a first turn is scored by its cached prefix
        router.record(key, router.choose(key, prompt=first.prompt), first.prompt, sticky=True)
        router._sticky[key] = 1  # the conversation lives on replica 1 (its rendezvous first choice is 0)
        later = await service.route_hint(payload, sticky=True, key=key)
        assert later.prompt is None and len(tokenized) == 1  # kept on replica 1: no /tokenize before sending
        assert router.choose(key, prompt=later.prompt, sticky=True).index == 1
        router.mark_down(proxy.fleet.urls[1])
        proxy.fleet.set_down(proxy.fleet.urls[1])
        moved = await service.route_hint(payload, sticky=True, key=key)
        assert moved.prompt is not None and len(tokenized) == 2  # its replica is down: score the survivors
        router.mark_up(proxy.fleet.urls[1])
        proxy.fleet.set_down(proxy.fleet.urls[1], down=False)
        for engine in proxy.engines:
            engine.fail_next(10, status=500)
        router._sticky.clear()
        failed = await service.route_hint(payload, sticky=True, key=key)
        assert failed.prompt is None  # the tokenization failed: counted, routed by key
        metrics = (await proxy.client.get("/metrics")).text
        assert 'cpmemory_fallbacks_total{kind="route_tokenize"} 1.0' in metrics
    finally:
        await http.aclose()


async def test_with_a_local_tokenizer_no_prompt_goes_to_tokenize_and_the_hashes_are_the_local_ones(
        make_proxy, tmp_path) -> None:
    """``--tokenizer``: the prompt's engine hashes for routing and for eviction sync come from the proxy's own
    tokenizer (the served model's), so no ``/tokenize`` request reaches a replica."""
    import pytest

    pytest.importorskip("transformers")
    from cpmemory.engines.local_tokenizer import LocalTokenizer
    from cpmemory.routing.prefix import engine_blocks
    from tests.chat_tokenizer import build_chat_tokenizer

    local = LocalTokenizer(str(build_chat_tokenizer(tmp_path)))
    proxy, hub, syncs, http, tokenized = synced_proxy(make_proxy, 4, tokenizer=local)
    service = proxy.service
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is it? " * 8}]
    payload = {"model": "tiny", "messages": messages}
    try:
        hint = await service.route_hint(payload, sticky=False, key="k")
        assert hint.prompt is not None and tokenized == []
        assert list(hint.prompt.keys) == list(engine_blocks(local.tokenize_now(messages), syncs[0].hasher,
                                                            None).keys)
        hub.register_later(1, "req-1", payload, "default")
        await asyncio.gather(*hub._pending)
        assert tokenized == [] and hub.failures == 0
        assert syncs[1].stats.registered == 1 and syncs[0].stats.registered == 0
    finally:
        await http.aclose()
