"""Tenant isolation through the proxy: API keys map to tenants; no state, index or cache salt is shared."""
from __future__ import annotations

import pytest

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
SHARED = [{"id": f"s{i}", "text": f"Shared document {i}. " + "lorem ipsum dolor " * 30} for i in range(4)]
SECRET = "Alice's secret question about the merger"
SALT_SECRET = "a-test-only-secret-of-32-characters!"


def body(conversation: str, question: str, blocks: list[dict]) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": question}],
            "cpmemory": {"conversation_id": conversation, "blocks": blocks}}


@pytest.fixture
async def tenants(make_proxy):
    proxy = make_proxy(api_keys=KEYS, cache_salt_secret=SALT_SECRET)
    yield proxy
    await proxy.aclose()


def sent_messages(proxy, request_id: str) -> list[dict]:
    for engine in proxy.engines:
        for record in engine.requests:
            if record["body"]["request_id"] == request_id:
                return record["body"]["messages"]
    raise AssertionError(request_id)


async def test_api_keys_are_required_when_configured(tenants) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-alice"}):
        response = await tenants.client.post("/v1/chat/completions", json=body("c", "q", SHARED), headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        evict = await tenants.client.post("/v1/cpmemory/evictions", json={"request_ids": []}, headers=headers)
        assert evict.status_code == 401
    assert all(not engine.requests for engine in tenants.engines)


async def test_bob_cannot_dedup_against_or_read_alice(tenants) -> None:
    alice = await tenants.client.post("/v1/chat/completions", json=body("same-id", SECRET, SHARED), headers=ALICE)
    assert alice.status_code == 200
    bob = await tenants.client.post("/v1/chat/completions", json=body("same-id", "bob asks", SHARED), headers=BOB)
    info = bob.json()["cpmemory"]
    assert info["turn"] == 1 and {d["status"] for d in info["decisions"]} == {"new"}
    bob_prompt = "".join(m["content"] for m in sent_messages(tenants, info["request_id"]))
    assert SECRET not in bob_prompt
    alice2 = await tenants.client.post("/v1/chat/completions", json=body("same-id", "again", SHARED), headers=ALICE)
    assert alice2.json()["cpmemory"]["turn"] == 2
    assert {d["status"] for d in alice2.json()["cpmemory"]["decisions"]} == {"referenced"}


async def test_bob_cannot_evict_alice_leaves(tenants) -> None:
    alice = await tenants.client.post("/v1/chat/completions", json=body("e", "q", SHARED), headers=ALICE)
    request_id = alice.json()["cpmemory"]["request_id"]
    memory = tenants.service.memory
    size = memory.index_size("alice")
    evicted = await tenants.client.post("/v1/cpmemory/evictions", json={"request_ids": [request_id]}, headers=BOB)
    assert evicted.json() == {"evicted": 0} and memory.index_size("alice") == size
    evicted = await tenants.client.post("/v1/cpmemory/evictions", json={"request_ids": [request_id]}, headers=ALICE)
    assert evicted.json() == {"evicted": 1}


async def test_cache_salt_differs_per_tenant(make_proxy) -> None:
    tenants = make_proxy(engine_count=1, api_keys=KEYS, cache_salt_secret=SALT_SECRET)
    a = await tenants.client.post("/v1/chat/completions", json=body("x", "q", SHARED), headers=ALICE)
    b = await tenants.client.post("/v1/chat/completions", json=body("x", "q", SHARED), headers=BOB)
    salts = {}
    for engine in tenants.engines:
        for record in engine.requests:
            salts[record["body"]["request_id"]] = record["body"]["cache_salt"]
    salt_a, salt_b = salts[a.json()["cpmemory"]["request_id"]], salts[b.json()["cpmemory"]["request_id"]]
    assert salt_a != salt_b and salt_a == tenants.service.cache_salt("alice")
    # the mock engine hashes the salt into its blocks: Bob gets no cached tokens from Alice's identical prompt,
    # while Alice's own repeat is served from the cache
    assert b.json()["cpmemory"]["cached_tokens"] == 0
    again = await tenants.client.post("/v1/chat/completions", json=body("y", "q", SHARED), headers=ALICE)
    assert again.json()["cpmemory"]["cached_tokens"] > 0
    await tenants.aclose()


async def test_cross_session_reordering_stays_inside_a_tenant(tenants, make_proxy) -> None:
    # Alice builds an index branch over [s3, s2, s1]; her new request is reordered along it, Bob's is not.
    for i in range(3):
        await tenants.client.post("/v1/chat/completions", json=body(f"a{i}", "q", [SHARED[3], SHARED[2], SHARED[1]]),
                                  headers=ALICE)
    probe = [SHARED[1], SHARED[0], SHARED[2], SHARED[3]]
    alice = await tenants.client.post("/v1/chat/completions", json=body("a-new", "q", probe), headers=ALICE)
    bob = await tenants.client.post("/v1/chat/completions", json=body("b-new", "q", probe), headers=BOB)
    fresh_proxy = make_proxy(api_keys=KEYS, cache_salt_secret=SALT_SECRET)
    fresh = await fresh_proxy.client.post("/v1/chat/completions", json=body("b-new", "q", probe), headers=BOB)
    await fresh_proxy.aclose()

    def order(response) -> list[int | None]:
        return [d["prompt_position"] for d in response.json()["cpmemory"]["decisions"]]

    assert order(bob) == order(fresh)
    assert order(alice) != order(bob)  # Alice's own history does reorder (the test can fail)


async def test_a_single_tenant_proxy_without_salts_sends_none_and_tenants_cannot_turn_them_off(make_proxy) -> None:
    """``--no-cache-salt``: no salt is added (a client's own passes on), so a gateway that cannot hash salted
    requests can prefix-route them; with API keys (several tenants) it is refused, since salts keep them apart."""
    import pydantic

    from cpmemory.server.config import ServerConfig

    plain = make_proxy(engine_count=1, cache_salt=False)
    await plain.client.post("/v1/chat/completions", json=body("x", "q", SHARED))
    own = {**body("y", "q", SHARED), "cache_salt": "client-chosen"}
    await plain.client.post("/v1/chat/completions", json=own)
    sent = [record["body"] for engine in plain.engines for record in engine.requests]
    assert "cache_salt" not in sent[0] and sent[1]["cache_salt"] == "client-chosen"
    salted = make_proxy(engine_count=1)
    await salted.client.post("/v1/chat/completions", json=body("x", "q", SHARED))
    assert salted.engines[0].requests[-1]["body"]["cache_salt"] == salted.service.cache_salt("default")
    with pytest.raises(pydantic.ValidationError, match="single-tenant"):
        ServerConfig(engines=["http://e"], api_keys=KEYS, cache_salt_secret=SALT_SECRET, cache_salt=False)
