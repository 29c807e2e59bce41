"""The engine contract: what cpmemory relies on from an OpenAI-compatible engine, run against the mock engine and
(marker ``vllm``, ``CPM_VLLM_URL`` from ``.ci/vllm.env``) the real vLLM.

Both go through the one engine client (:class:`~cpmemory.engines.client.AsyncEngineClient`) and are read by the one
wire module. The last tests check the three prefix-cache models against each other: the mock and vLLM report, for
the same prompt sequence, the cached tokens the simulator (``cpmemory.bench.simulator``, vLLM mode) computes from
that engine's own tokens, within one block.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.engines.client import AsyncEngineClient, EngineSettings
from cpmemory.engines.openai_wire import (
    CHAT_PATH,
    SseLineBuffer,
    StreamState,
    chat_body,
    is_usage_chunk,
    request_headers,
    sse_data,
)
from cpmemory.testing.mock_engine import MockEngine

SYSTEM = " ".join(f"Rule {i}: every answer cites the block it comes from and keeps to the facts." for i in range(40))


@dataclass
class Engine:
    """An engine under test: its client and its KV block size."""

    name: str
    client: AsyncEngineClient
    block_size: int


@pytest.fixture(params=["mock", pytest.param("vllm", marks=pytest.mark.vllm)])
async def engine(request) -> AsyncIterator[Engine]:
    if request.param == "mock":
        mock = MockEngine(block_size=16, capacity_blocks=1 << 14)
        client = AsyncEngineClient("http://mock", transport=mock.transport())
    else:
        url = os.environ.get("CPM_VLLM_URL")
        if not url:
            pytest.skip("CPM_VLLM_URL not set (start the CI servers with .ci/vllm.sh ci-up; source .ci/vllm.env)")
        client = AsyncEngineClient(EngineSettings(base_url=url, timeout_s=120))
    try:
        yield Engine(request.param, client, (await client.cache_config()).block_size)
    finally:
        await client.aclose()


def fresh(question: str = "Which rule applies?") -> list[dict[str, str]]:
    """A prompt no engine has seen: a unique nonce first, then the shared system text and a question."""
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex}. {SYSTEM}"},
            {"role": "user", "content": question}]


async def stream_chunks(engine: Engine, messages: list[dict[str, str]], **extra: Any) -> tuple[list[dict], StreamState]:
    """Send a streaming request exactly as given (no stream options unless ``extra`` has them); return its chunks."""
    request_id = f"contract-{uuid.uuid4().hex}"
    body = chat_body(messages, model=engine.client.settings.model, request_id=request_id, stream=False,
                     max_tokens=4, extra={"stream": True, "temperature": 0.0, **extra})
    opened = await engine.client.open_stream(CHAT_PATH, body, request_headers(request_id))
    chunks: list[dict] = []
    state, lines = StreamState(), SseLineBuffer()
    try:
        async for piece in opened.aiter_bytes():
            for line in lines.feed(piece):
                data = sse_data(line)
                if data is not None:
                    chunk, _ = state.apply_data(data)
                    if chunk is not None:
                        chunks.append(dict(chunk))
    finally:
        await opened.aclose()
    assert state.done and not state.malformed and state.error is None
    return chunks, state


async def test_chat_reports_text_and_usage_and_names_the_completion(engine: Engine) -> None:
    messages = fresh()
    result = await engine.client.chat(messages, request_id="contract-id-1", max_tokens=4, extra={"temperature": 0})
    assert isinstance(result.content, str) and result.finish_reason in ("length", "stop")
    assert result.prompt_tokens == len(await engine.client.tokenize(messages))
    assert result.cached_tokens == 0 and result.completion_tokens is not None
    assert result.response_id is not None and "contract-id-1" in result.response_id


async def test_stream_reads_like_the_plain_answer(engine: Engine) -> None:
    messages = fresh()
    # both calls find the same prefix cached: on vLLM a prompt read from the cache and one computed afresh can round
    # differently in bf16, and the tiny random model's near-tied logits then pick another greedy token
    await engine.client.chat(messages, max_tokens=1, extra={"temperature": 0.0})
    plain = await engine.client.chat(messages, max_tokens=4, extra={"temperature": 0.0})
    streamed = await engine.client.chat(messages, max_tokens=4, stream=True, extra={"temperature": 0.0})
    assert streamed.content == plain.content and streamed.prompt_tokens == plain.prompt_tokens
    assert streamed.ttft_s is not None and streamed.ttft_s <= streamed.total_s


async def test_usage_chunk_comes_only_when_asked(engine: Engine) -> None:
    silent, _ = await stream_chunks(engine, fresh())
    assert silent and all(chunk.get("choices") for chunk in silent)  # every chunk has a choice to read
    assert all(chunk.get("usage") is None for chunk in silent)
    asked, state = await stream_chunks(engine, fresh(), stream_options={"include_usage": True})
    usage = [chunk for chunk in asked if is_usage_chunk(chunk)]
    assert len(usage) == 1 and asked[-1] is usage[0] and state.usage is not None
    assert state.usage["prompt_tokens"] > 0


async def test_n_choices_stream_with_their_index(engine: Engine) -> None:
    _, state = await stream_chunks(engine, fresh(), n=2, temperature=0.8, seed=7)  # vLLM: n > 1 needs sampling
    assert state.finish_reason(0) is not None and state.finish_reason(1) is not None
    assert state.finish_reason(2) is None


async def test_cached_tokens_are_the_leading_full_blocks_but_the_last_token(engine: Engine) -> None:
    messages = fresh()
    first = await engine.client.chat(messages, max_tokens=1)
    second = await engine.client.chat(messages, max_tokens=1)
    assert first.cached_tokens == 0
    assert second.cached_tokens == (second.prompt_tokens - 1) // engine.block_size * engine.block_size


async def test_cache_salt_isolates_tenants(engine: Engine) -> None:
    messages = fresh()
    await engine.client.chat(messages, max_tokens=1, cache_salt="tenant-a")
    assert (await engine.client.chat(messages, max_tokens=1, cache_salt="tenant-b")).cached_tokens == 0
    assert (await engine.client.chat(messages, max_tokens=1)).cached_tokens == 0
    assert (await engine.client.chat(messages, max_tokens=1, cache_salt="tenant-a")).cached_tokens > 0


def prompt_sequence() -> list[list[dict[str, str]]]:
    """Prompts sharing prefixes in several ways: the same system text with other questions, a repeat, a longer
    history, and an unrelated prompt."""
    nonce = uuid.uuid4().hex
    system = {"role": "system", "content": f"Session {nonce}. {SYSTEM}"}
    other = {"role": "system", "content": f"Other {nonce}. " + SYSTEM[::-1]}
    q1, q2 = {"role": "user", "content": "Which rule applies?"}, {"role": "user", "content": "Name rule 7."}
    answer = {"role": "assistant", "content": "Rule 7 applies here, as the block says."}
    return [[system, q1], [system, q2], [system, q1], [system, q1, answer, q2], [other, q1], [system, q2]]


async def cache_trace(engine: Engine) -> list[tuple[int, int, int]]:
    """(prompt tokens, engine's cached tokens, simulator's cached tokens) for each prompt of the sequence."""
    simulator = PrefixCacheSimulator(1 << 24, mode="vllm", page_size=engine.block_size)
    trace = []
    for messages in prompt_sequence():
        tokens = await engine.client.tokenize(messages)
        result = await engine.client.chat(messages, max_tokens=1)
        assert result.prompt_tokens == len(tokens)
        trace.append((len(tokens), int(result.cached_tokens or 0), simulator.run(tokens)))
    return trace


async def test_engine_and_simulator_agree_on_cached_tokens(engine: Engine) -> None:
    trace = await cache_trace(engine)
    for prompt_tokens, cached, simulated in trace:
        assert abs(cached - simulated) <= engine.block_size, trace
        assert cached <= prompt_tokens - 1
    assert trace[0][1] == 0 and trace[2][1] >= trace[1][1] > 0  # a shared system text hits, a repeat at least as much


@pytest.mark.vllm
async def test_mock_and_vllm_agree_on_which_prompts_hit_and_how_much() -> None:
    url = os.environ.get("CPM_VLLM_URL")
    if not url:
        pytest.skip("CPM_VLLM_URL not set")
    real = AsyncEngineClient(EngineSettings(base_url=url, timeout_s=120))
    try:
        block = (await real.cache_config()).block_size
        vllm = await cache_trace(Engine("vllm", real, block))
    finally:
        await real.aclose()
    # 32-byte blocks: the chat template's opening (19 bytes, a few tokens) stays under one block, as in vLLM
    mock = MockEngine(block_size=32, capacity_blocks=1 << 14)
    mocked = await cache_trace(Engine("mock", AsyncEngineClient("http://mock", transport=mock.transport()), 32))
    for (v_prompt, v_cached, _), (m_prompt, m_cached, _) in zip(vllm, mocked):
        assert (v_cached > 0) == (m_cached > 0), (vllm, mocked)
        # the share of the prompt served from cache, within one block of each engine's granularity
        tolerance = block / v_prompt + 32 / m_prompt + 0.05
        assert abs(v_cached / v_prompt - m_cached / m_prompt) <= tolerance, (vllm, mocked)
