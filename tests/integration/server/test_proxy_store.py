"""The proxy's session store on real Redis and a real Redis Cluster: ``redis+cluster://`` serves turns that are
recorded (not pass-through), and a store that cannot be used as configured is refused by the start check."""
from __future__ import annotations

import httpx
import pytest

from cpmemory.errors import StoreUnavailableError
from cpmemory.server.app import ServerConfig, create_app
from cpmemory.server.store_setup import StoreConfigurationError, build_store, check_store
from cpmemory.stores.redis_codec import RedisStoreConfig
from cpmemory.testing.fleet import MockFleet

BLOCKS = [{"id": f"doc-{i}", "text": f"Document {i}: " + f"fact {i} about the topic. " * 20} for i in range(3)]


def cluster_url(url: str) -> str:
    return url.replace("redis://", "redis+cluster://", 1).removesuffix("/0")


async def checked(url: str, prefix: str) -> None:
    store = build_store(ServerConfig(engines=["http://engine-0"], redis_url=url, redis=RedisStoreConfig(prefix=prefix)))
    try:
        await check_store(store)
    finally:
        await store.close()


@pytest.mark.cluster
async def test_turns_through_the_proxy_on_a_cluster_are_recorded(redis_cluster, run_prefix) -> None:
    fleet = MockFleet(1, block_size=16, capacity_blocks=4096)
    config = ServerConfig(engines=fleet.urls, redis_url=cluster_url(redis_cluster.url),
                          redis=RedisStoreConfig(prefix=run_prefix))
    await checked(config.redis_url or "", run_prefix)
    transport = fleet.chat_transport()
    app = create_app(config, transport=transport)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        infos = []
        for question in ("q1", "q2", "q3"):
            answer = await client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": question}],
                "cpmemory": {"conversation_id": "on-cluster", "blocks": BLOCKS}})
            assert answer.status_code == 200, answer.text
            infos.append(answer.json()["cpmemory"])
        assert [info["turn"] for info in infos] == [1, 2, 3]
        assert not any(info["degraded"] for info in infos) and all(info["committed"] for info in infos)
        assert {d["status"] for d in infos[2]["decisions"]} == {"referenced"}
        assert (await client.get("/readyz")).json()["store"] == "ok"
        assert app.state.service.salts.resolved  # the cache-salt secret is kept in the cluster, shared by workers
    await transport.aclose()


@pytest.mark.cluster
async def test_a_cluster_node_given_as_one_server_is_refused(redis_cluster, run_prefix) -> None:
    with pytest.raises(StoreConfigurationError, match=r"redis\+cluster://"):
        await checked(redis_cluster.url, run_prefix)


@pytest.mark.redis
async def test_a_single_server_given_as_a_cluster_is_refused(real_redis, run_prefix) -> None:
    await checked(real_redis, run_prefix)  # as given: usable
    with pytest.raises(StoreConfigurationError, match="cluster mode"):
        await checked(cluster_url(real_redis), run_prefix)


async def test_a_store_that_cannot_be_reached_is_refused(run_prefix) -> None:
    with pytest.raises(StoreUnavailableError, match="cannot be reached"):
        await checked("redis://127.0.0.1:1/0", run_prefix)
