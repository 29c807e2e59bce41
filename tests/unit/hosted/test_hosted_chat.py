"""The facade path: HostedChat / AsyncHostedChat prepare, send to a mock provider, commit; errors abort the turn."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

from cpmemory import AsyncCpMemory, CpMemory
from cpmemory.errors import EngineStatusError, EngineUnreachableError
from cpmemory.hosted import AsyncHostedChat, HostedChat, HostedSettings
from cpmemory.testing.hosted_mock import AnthropicCacheMock, OpenAICacheMock

MODELS = {"openai": "gpt-5", "anthropic": "claude-sonnet-4-5"}


def blocks(name: str, count: int = 3, words: int = 400) -> list[tuple[str, str]]:
    return [(f"{name}{index}", " ".join(f"{name}{index}w{word}" for word in range(words))) for index in range(count)]


def mock_of(provider: str) -> Any:
    return OpenAICacheMock() if provider == "openai" else AnthropicCacheMock()


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_conversation_reads_its_earlier_turns_and_deduplicates(provider: str) -> None:
    mock = mock_of(provider)
    settings = HostedSettings(provider=provider, api_key="test-key", base_url="http://provider")
    chat = HostedChat(settings, CpMemory(), http_client=httpx.Client(transport=mock.transport()))
    first = chat.turn("c1", "What is a0?", blocks("a"), model=MODELS[provider])
    second = chat.turn("c1", "And a1?", blocks("a"), model=MODELS[provider])
    assert first.committed == 1 and second.committed == 2
    assert second.info["cached_input_tokens"] >= first.info["input_tokens"] - 128
    assert {decision.status for decision in second.prepared.decisions} == {"referenced"}
    assert chat.totals.calls == 2 and chat.totals.cached_input_tokens == second.info["cached_input_tokens"]
    assert chat.totals.estimated_input_cost == pytest.approx(
        first.info["estimated_input_cost"] + second.info["estimated_input_cost"])


def test_a_refused_call_aborts_the_turn() -> None:
    mock = OpenAICacheMock()
    memory = CpMemory()
    client = httpx.Client(transport=mock.transport())
    refused = HostedChat(HostedSettings(provider="openai", api_key="wrong-key", base_url="http://provider"),
                         memory, http_client=client)
    with pytest.raises(EngineStatusError):
        refused.turn("c1", "q?", blocks("a", 1), model="gpt-5")
    assert memory.state("c1").open_reservations == 0
    chat = HostedChat(HostedSettings(provider="openai", api_key="test-key", base_url="http://provider"),
                      memory, http_client=client)
    again = chat.turn("c1", "q?", blocks("a", 1), model="gpt-5")
    assert again.committed == 1  # the refused turn left nothing behind: this is the conversation's first
    assert [decision.status for decision in again.prepared.decisions] == ["new"]


def test_an_unreachable_provider_is_an_engine_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    settings = HostedSettings(provider="anthropic", api_key="k", base_url="http://provider")
    chat = HostedChat(settings, CpMemory(), http_client=httpx.Client(transport=httpx.MockTransport(refuse)))
    with pytest.raises(EngineUnreachableError):
        chat.turn("c1", "q?", blocks("a", 1), model="claude-sonnet-4-5")


async def test_the_async_chat_reads_its_earlier_turns() -> None:
    mock = AnthropicCacheMock()
    settings = HostedSettings(provider="anthropic", api_key="test-key", base_url="http://provider",
                              model="claude-sonnet-4-5")
    chat = AsyncHostedChat(settings, AsyncCpMemory(), http_client=httpx.AsyncClient(transport=mock.transport()))
    first = await chat.turn("c1", "What is a0?", blocks("a"))
    second = await chat.turn("c1", "And b0?", blocks("b"))
    assert second.info["cached_input_tokens"] >= first.info["input_tokens"]
    assert 1 <= second.info["breakpoints"] <= 4
    await chat.aclose()
