"""A short soak: conversations come and go through the proxy for ~20 s; RSS stays flat after warm-up and every
per-conversation / per-request structure stays under its cap (store TTL, index cap, pending-turn cap)."""
from __future__ import annotations

import asyncio
import gc
import os
import time

import httpx
import psutil

from cpmemory.facade import AsyncCpMemory
from cpmemory.server.app import ServerConfig, create_app
from cpmemory.session.config import CpMemoryConfig
from cpmemory.stores.memory import AsyncInMemorySessionStore
from cpmemory.testing.fleet import MockFleet

WARM_UP_S = 5.0
SOAK_S = 16.0
LEAF_CAP = 300
RSS_GROWTH_BOUND_MB = 64.0  # generous: the measured growth is reported, and is far below this

FLEET = MockFleet(2, block_size=64, capacity_blocks=2048)


async def _conversation(client: httpx.AsyncClient, number: int) -> None:
    for turn in range(3):
        blocks = [{"id": f"d{(number + turn + i) % 40}", "text": f"document {(number + turn + i) % 40} " * 30}
                  for i in range(5)]
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"q{turn}"}],
                "cpmemory": {"conversation_id": f"soak-{number}", "blocks": blocks}}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text


def _rss_mb() -> float:
    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def _leaf_count(memory: AsyncCpMemory) -> int:
    index = memory._indexes._indexes["default"]
    return int(getattr(index, "leaf_count", len(index)))


def test_index_request_map_is_bounded() -> None:
    from cpmemory.core.index import ContextIndex

    index = ContextIndex(max_leaves=10)
    for number in range(2000):
        index.insert(["a", "b", str(number % 5)], f"r{number}")
    assert len(index) <= 10 * 50


async def test_soak_rss_is_flat_after_warm_up() -> None:
    store = AsyncInMemorySessionStore(ttl_s=1.0)
    memory = AsyncCpMemory(store=store, config=CpMemoryConfig(max_leaves_per_tenant=LEAF_CAP,
                                                              max_pending_turns=500))
    transport = FLEET.chat_transport()
    app = create_app(ServerConfig(engines=FLEET.urls), memory=memory,
                     transport=transport)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")
    started, number, samples, warm = time.monotonic(), 0, [], None
    try:
        while time.monotonic() - started < SOAK_S:
            await asyncio.gather(*(_conversation(client, number + i) for i in range(20)))
            number += 20
            FLEET.calls.clear()  # the fleet's and the mocks' request logs are test artefacts, not proxy state
            for engine in FLEET.engines.values():
                engine.requests.clear()
                engine.batches.clear()
            if warm is None and time.monotonic() - started >= WARM_UP_S:
                gc.collect()
                warm = _rss_mb()
            elif warm is not None:
                samples.append(_rss_mb())
    finally:
        await client.aclose()
        await transport.aclose()
    gc.collect()
    final = _rss_mb()
    growth = max(samples + [final]) - warm
    print(f"\nsoak: {number} conversations, {number * 3} requests in {SOAK_S:.0f}s; RSS after warm-up "
          f"{warm:.1f} MB, final {final:.1f} MB, max growth {growth:.1f} MB; index leaves "
          f"{_leaf_count(memory)}, requests {memory.index_size('default')}; live conversations {len(store.sync)}")
    assert number >= 100
    assert _leaf_count(memory) <= LEAF_CAP
    assert len(memory._pending) <= 500
    assert growth < RSS_GROWTH_BOUND_MB
