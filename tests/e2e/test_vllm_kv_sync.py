"""Real vLLM (CPM_VLLM_URL + CPM_VLLM_KV_ENDPOINT): the proxy's KV-event sync registers each turn's prompt with the
tenant's cache_salt, and the block hashes it computes match the ones vLLM publishes in BlockStored events, whether
the prompt was tokenized by the engine's ``/tokenize`` or by the proxy's local tokenizer of the served model
(``--tokenizer``, the model directory CPM_VLLM_MODEL), and that with ``--tokenizer auto`` the proxy finds that
tokenizer itself from what vLLM's ``/v1/models`` names."""
from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from cpmemory.server.app import ServerConfig, create_app

pytestmark = pytest.mark.vllm
URL = os.environ.get("CPM_VLLM_URL")
KV_ENDPOINT = os.environ.get("CPM_VLLM_KV_ENDPOINT")
if not (URL and KV_ENDPOINT):
    pytest.skip("CPM_VLLM_URL and CPM_VLLM_KV_ENDPOINT are not set", allow_module_level=True)
MODEL = os.environ.get("CPM_VLLM_MODEL", "/root/.cache/cpmemory/tiny-model")
LOCAL = pytest.param("local", marks=pytest.mark.skipif(not os.path.isdir(MODEL), reason=f"no model dir {MODEL}"))


@pytest.mark.parametrize("tokenizer", ["engine", LOCAL])
async def test_turns_register_with_the_tenant_salt_and_hashes_match_vllm(tokenizer: str) -> None:
    app = create_app(ServerConfig(engines=[URL], kv_events=[KV_ENDPOINT], engine_timeout_s=300,
                                  tokenizer=MODEL if tokenizer == "local" else None))
    service = app.state.service
    stamp = time.time_ns()  # fresh text: vLLM must store (and publish) new blocks for this run
    blocks = [{"id": f"k{i}", "text": f"Run {stamp} block {i}: " + "the harbor ledger lists every ship. " * 40}
              for i in range(2)]
    async with app.router.lifespan_context(app):
        await asyncio.sleep(1.0)  # ZMQ subscription settles before the first event
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=300)
        for turn in range(2):
            body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": f"q{turn}"}],
                    "cpmemory": {"conversation_id": f"kv-{stamp}", "blocks": blocks}}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = service.kv_sync.stats().get(0)
            if stats is not None and stats.registered >= 2 and stats.hash_matches >= 1:
                break
            await asyncio.sleep(0.5)
        await client.aclose()
    assert stats is not None and stats.registered >= 2, stats
    print(f"\nkv sync on real vLLM: {stats}")
    assert stats.hash_matches >= 1 and stats.hash_mismatches == 0, stats


@pytest.mark.skipif(not os.path.isdir(MODEL), reason=f"no model dir {MODEL}")
async def test_the_local_tokenizer_gives_the_engines_tokens() -> None:
    """The contract behind ``--tokenizer``: for the same messages, the ids the proxy builds are vLLM's ``/tokenize``
    ids (system prompts, multi-turn history, non-ASCII text, an empty message)."""
    from cpmemory.engines.client import AsyncEngineClient, EngineSettings
    from cpmemory.engines.local_tokenizer import LocalTokenizer

    local = LocalTokenizer(MODEL)
    conversations = [
        [{"role": "user", "content": "What is the harbor ledger?"}],
        [{"role": "system", "content": "Answer briefly.\n\n[doc-1] The ledger lists every ship."},
         {"role": "user", "content": "Which ships?"}, {"role": "assistant", "content": "All of them."},
         {"role": "user", "content": "And in 1850?"}],
        [{"role": "user", "content": "Café naïve — 東京 ✓ " * 20}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced   out  "}],
    ]
    async with AsyncEngineClient(EngineSettings(base_url=URL, timeout_s=120)) as engine:
        for messages in conversations:
            assert await local.tokenize(messages) == await engine.tokenize(messages, model="tiny"), messages


@pytest.mark.skipif(not os.path.isdir(MODEL), reason=f"no model dir {MODEL}")
async def test_with_tokenizer_auto_the_proxy_adopts_the_engines_own_and_counts_as_vllm() -> None:
    """vLLM's ``/v1/models`` names its model directory (``root``); on this machine the proxy loads it, checks it
    against ``/tokenize`` and then counts prompts and hashes KV events with it: no ``/tokenize`` round trips."""
    from cpmemory.engines.client import AsyncEngineClient, EngineSettings
    from cpmemory.engines.local_tokenizer import LocalTokenizer

    app = create_app(ServerConfig(engines=[URL], kv_events=[KV_ENDPOINT], engine_timeout_s=300, tokenizer="auto"))
    service = app.state.service
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Which ships does the harbor ledger list? " * 30}]
    async with app.router.lifespan_context(app):
        for _ in range(300):  # found in the background after start (60 s at most)
            if service.metrics.local_tokenizer._value.get() == 1:
                break
            await asyncio.sleep(0.2)
        assert service.metrics.local_tokenizer._value.get() == 1, "the engine's tokenizer was not adopted"
        assert isinstance(service.kv_sync.tokenizer, LocalTokenizer)
        counted = await service.engine_budget.count("tiny", messages)
    async with httpx.AsyncClient() as http:
        engine = AsyncEngineClient(EngineSettings(base_url=URL, timeout_s=60), http=http)
        assert counted == len(await engine.tokenize(messages, model="tiny"))
