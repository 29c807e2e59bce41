"""The proxy in front of a hosted provider: the openai SDK talks to the proxy (OpenAI-compatible), the proxy talks
to a local mock of each provider (cpmemory.testing.hosted_mock) in the provider's own API.

Every turn's ``cpmemory`` field carries ``hosted`` (tokens read, written, uncached, the estimated cost); ``/metrics``
totals them; a conversation's later turns read its earlier prompt from the provider's cache.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from cpmemory.hosted import HostedSettings, HostedTransport
from cpmemory.server.app import ServerConfig, create_app
from cpmemory.testing.hosted_mock import AnthropicCacheMock, OpenAICacheMock

openai = pytest.importorskip("openai")

MODELS = {"openai": "gpt-5", "anthropic": "claude-sonnet-4-5"}


def document(name: str, words: int = 700) -> dict[str, str]:
    return {"id": name, "text": " ".join(f"{name}{index}" for index in range(words))}


class HostedProxy:
    def __init__(self, provider: str, **settings: Any) -> None:
        self.mock = OpenAICacheMock() if provider == "openai" else AnthropicCacheMock()
        hosted = HostedSettings(provider=provider, api_key="test-key", base_url="http://provider", **settings)
        upstream = HostedTransport(hosted, client=httpx.AsyncClient(transport=self.mock.transport()))
        self.app = create_app(ServerConfig(engines=["http://provider"], hosted=hosted), transport=upstream)
        self.upstream = upstream
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://proxy")
        self.sdk = openai.AsyncOpenAI(api_key="any", base_url="http://proxy/v1", http_client=self.http, max_retries=0)
        self.model = MODELS[provider]

    async def turn(self, conversation: str, question: str, blocks: list[dict[str, str]], **options: Any) -> Any:
        return await self.sdk.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": question}],
            extra_body={"cpmemory": {"conversation_id": conversation, "blocks": blocks}}, **options)

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.upstream.aclose()


@pytest.fixture(params=["openai", "anthropic"])
async def proxy(request: pytest.FixtureRequest) -> AsyncIterator[HostedProxy]:
    made = HostedProxy(request.param)
    yield made
    await made.aclose()


async def test_every_turn_reports_the_providers_cache_and_cost(proxy: HostedProxy) -> None:
    first = await proxy.turn("c1", "Who is a0?", [document("a"), document("b")])
    second = await proxy.turn("c1", "And b3?", [document("b"), document("c")])
    one, two = first.model_extra["cpmemory"]["hosted"], second.model_extra["cpmemory"]["hosted"]
    assert one["cached_input_tokens"] == 0 and one["input_tokens"] > 1024
    assert two["cached_input_tokens"] >= one["input_tokens"] - 128  # the second turn reads the first prompt
    assert two["estimated_input_cost"] < two["input_tokens"] * 3.0 / 1e6  # under the plain input price
    assert second.usage.prompt_tokens_details.cached_tokens == two["cached_input_tokens"]
    assert second.model_extra["cpmemory"]["decisions"]  # the proxy's own fields are still there


async def test_metrics_total_the_hosted_tokens_and_cost(proxy: HostedProxy) -> None:
    await proxy.turn("c1", "Who is a0?", [document("a", 1200)])
    await proxy.turn("c1", "And a1?", [document("a", 1200)])
    totals = proxy.upstream.counters.totals
    text = (await proxy.http.get("/metrics")).text
    read = [line for line in text.splitlines() if line.startswith("cpmemory_hosted_input_tokens_total")
            and 'kind="cache_read"' in line]
    assert read and float(read[0].rsplit(" ", 1)[1]) == totals.cached_input_tokens > 0
    cost = [line for line in text.splitlines() if line.startswith("cpmemory_hosted_estimated_input_cost_total")]
    assert cost and float(cost[0].rsplit(" ", 1)[1]) == pytest.approx(totals.estimated_input_cost)


async def test_a_streamed_turn_is_relayed_and_counted(proxy: HostedProxy) -> None:
    stream = await proxy.turn("c2", "Who is a0?", [document("a")], stream=True,
                              stream_options={"include_usage": True})
    parts, usage = [], None
    async for chunk in stream:
        parts.extend(choice.delta.content or "" for choice in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(parts) == "OK."
    assert usage is not None and usage.prompt_tokens > 700
    assert proxy.upstream.counters.totals.calls == 1


async def test_the_provider_receives_its_own_api() -> None:
    proxy = HostedProxy("anthropic")
    try:
        await proxy.turn("c3", "Who is a0?", [document("a")])
        await proxy.turn("c3", "And a1?", [document("a"), document("b")])
        sent = proxy.mock.calls[-1].body
        marked = [block for message in sent["messages"] for block in message["content"] if "cache_control" in block]
        marked += [block for block in sent.get("system", []) if "cache_control" in block]
        assert 1 <= len(marked) <= 4
        assert sent["max_tokens"] == 1024 and "cpmemory" not in sent
    finally:
        await proxy.aclose()


async def test_stateless_calls_that_share_a_prefix_share_the_cache() -> None:
    """A plain request (no conversation) gets the key of its prompt's start: calls that open with the same
    context reach the same cache."""
    proxy = HostedProxy("openai")
    try:
        context = document("a", 1500)["text"]
        for question in ("Who is a0?", "Who is a1?"):
            answer = await proxy.sdk.chat.completions.create(
                model=proxy.model, messages=[{"role": "system", "content": "Answer from the context."},
                                             {"role": "user", "content": f"{context}\n\nQuestion: {question}"}])
        keys = {call.body["prompt_cache_key"] for call in proxy.mock.calls}
        assert len(keys) == 1
        assert answer.usage.prompt_tokens_details.cached_tokens >= 1024
        assert answer.model_extra["cpmemory"]["hosted"]["cached_input_tokens"] >= 1024
    finally:
        await proxy.aclose()
