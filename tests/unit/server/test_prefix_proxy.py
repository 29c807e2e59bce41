"""The proxy's prefix-aware routing over mock engines: first turns find the replica holding their prefix."""
from __future__ import annotations

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
