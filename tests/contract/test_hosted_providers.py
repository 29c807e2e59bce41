"""One contract suite over both hosted providers: the real ``openai`` / ``anthropic`` SDK sends what
cpmemory.hosted builds to a local server applying that provider's documented cache rules (cpmemory.testing.hosted_mock).

Each case knows how to send an OpenAI-style chat with its SDK; the assertions are the rules every provider shares
(a minimum, a prefix read on repeat, the next turn reading the previous prompt, a changed start missing, the
lifetime, the cost from the price table), then each provider's own (increments and cache keys; breakpoints, the
per-model minimum, the one-hour lifetime, the lookback).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from cpmemory.hosted import CONVERSATION_PLACEMENT, HostedProvider, HostedSettings, PriceTable
from cpmemory.hosted.prices import HostedUsage, parse_hosted_usage
from cpmemory.testing.hosted_mock import AnthropicCacheMock, ManualClock, OpenAICacheMock

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


def words(count: int, seed: str) -> str:
    """``count`` distinct words (one mock token each)."""
    return " ".join(f"{seed}{index}" for index in range(count))


def openai_client(mock: Any) -> Any:
    http = httpx.Client(transport=mock.transport())
    return openai.OpenAI(api_key="test-key", base_url="http://mock/v1", http_client=http, max_retries=0)


def anthropic_client(mock: Any) -> Any:
    """The SDK over the mock, on the httpx flavour the installed SDK is built on."""
    http = sdk_http_module(anthropic)
    return anthropic.Anthropic(api_key="test-key", base_url="http://mock",
                               http_client=http.Client(transport=mock.transport(http)), max_retries=0)


def sdk_http_module(sdk: Any) -> Any:
    import importlib

    base = importlib.import_module(f"{sdk.__name__}._base_client")
    return importlib.import_module("httpx2") if "httpx2" in vars(base) else httpx


@dataclass
class Case:
    name: str
    model: str
    make: Callable[[ManualClock], Any]
    minimum: int
    lifetime_s: float

    def send(self, mock: Any, messages: Sequence[Mapping[str, Any]], *, key: str | None = None,
             **settings: Any) -> HostedUsage:
        provider = HostedProvider(HostedSettings(provider=self.name, api_key="test-key", **settings))
        request = provider.request({"model": self.model, "messages": list(messages)}, cache_key=key)
        if self.name == "openai":
            answer = openai_client(mock).chat.completions.create(**request.body)
        else:
            answer = anthropic_client(mock).messages.create(**request.body)
        return parse_hosted_usage(answer.usage.model_dump())


CASES = [
    Case("openai", "gpt-5", lambda clock: OpenAICacheMock(clock=clock), 1024, 300.0),
    Case("anthropic", "claude-sonnet-4-5", lambda clock: AnthropicCacheMock(clock=clock), 1024, 300.0),
]


@pytest.fixture(params=CASES, ids=[case.name for case in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param  # type: ignore[no-any-return]


def chat(system: str, *turns: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}]
    for index, text in enumerate(turns):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return messages


def test_a_prompt_below_the_minimum_is_never_cached(case: Case) -> None:
    clock = ManualClock()
    mock = case.make(clock)
    messages = chat("be brief", words(case.minimum // 2, "w"))
    first, second = case.send(mock, messages), case.send(mock, messages)
    assert first.cache_read_tokens == second.cache_read_tokens == 0
    assert second.cache_write_tokens == 0
    assert second.input_tokens == first.input_tokens > 0


def test_a_repeated_long_prompt_is_read_from_the_cache(case: Case) -> None:
    mock = case.make(ManualClock())
    messages = chat(words(300, "s"), words(3000, "d") + "\n\nQuestion: why?")
    first = case.send(mock, messages)
    second = case.send(mock, messages)
    assert first.cache_read_tokens == 0
    assert second.cache_read_tokens >= second.input_tokens - 128
    assert second.cache_read_tokens <= second.input_tokens


def test_the_next_turn_reads_the_previous_prompt(case: Case) -> None:
    mock = case.make(ManualClock())
    turn_one = chat(words(200, "s"), words(2000, "a") + "\n\nQuestion: one?")
    first = case.send(mock, turn_one)
    turn_two = [*turn_one, {"role": "assistant", "content": "an answer"},
                {"role": "user", "content": words(500, "b") + "\n\nQuestion: two?"}]
    second = case.send(mock, turn_two)
    assert first.input_tokens - 128 <= second.cache_read_tokens <= first.input_tokens


def test_a_changed_start_misses(case: Case) -> None:
    """Mem0's documented prompt: this turn's memories in the system message move the prompt's start."""
    mock = case.make(ManualClock())
    history = [words(2000, "h"), "an answer"]
    case.send(mock, chat("memories: " + words(50, "m"), *history, "Question: one?"))
    again = case.send(mock, chat("memories: " + words(50, "n"), *history, "Question: one?"))
    assert again.cache_read_tokens == 0


def test_an_entry_lives_its_lifetime_after_its_last_use(case: Case) -> None:
    clock = ManualClock()
    mock = case.make(clock)
    messages = chat(words(100, "s"), words(2000, "d"))
    case.send(mock, messages)
    clock.advance(case.lifetime_s * 0.8)
    assert case.send(mock, messages).cache_read_tokens > 0  # read: the lifetime starts again
    clock.advance(case.lifetime_s * 0.8)
    assert case.send(mock, messages).cache_read_tokens > 0
    clock.advance(case.lifetime_s + 1)
    assert case.send(mock, messages).cache_read_tokens == 0


def test_the_cost_follows_the_price_table(case: Case) -> None:
    mock = case.make(ManualClock())
    messages = chat(words(100, "s"), words(2000, "d"))
    case.send(mock, messages)
    usage = case.send(mock, messages)
    price = PriceTable().find(case.model)
    assert price is not None
    expected = (usage.uncached_tokens * price.input + usage.cache_read_tokens * price.cache_read
                + usage.cache_write_tokens * price.cache_write) / 1e6
    assert usage.input_cost(price) == pytest.approx(expected)
    assert usage.input_cost(price) < usage.input_tokens * price.input / 1e6


# -------------------------------------------------------------------------------------------------- OpenAI only

def test_openai_reads_in_increments_above_the_minimum() -> None:
    mock = OpenAICacheMock()
    case = CASES[0]
    messages = chat(words(100, "s"), words(1900, "d"))
    case.send(mock, messages)
    usage = case.send(mock, [*messages, {"role": "assistant", "content": "x"},
                             {"role": "user", "content": words(77, "q")}])
    assert usage.cache_read_tokens >= 1024 and (usage.cache_read_tokens - 1024) % 128 == 0


def test_openai_routes_by_prompt_cache_key() -> None:
    mock = OpenAICacheMock()
    case = CASES[0]
    messages = chat(words(100, "s"), words(2000, "d"))
    case.send(mock, messages, key="conversation-a")
    assert case.send(mock, messages, key="conversation-b").cache_read_tokens == 0
    assert case.send(mock, messages, key="conversation-a").cache_read_tokens > 0


def test_openai_refuses_the_engine_only_fields_cpmemory_strips() -> None:
    mock = OpenAICacheMock()
    client = openai_client(mock)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"cache_salt": "tenant-salt"})
    body = HostedProvider(HostedSettings(provider="openai")).request(
        {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "s", "request_id": "r"}).body
    assert "cache_salt" not in body and "request_id" not in body and body["prompt_cache_key"]


# ----------------------------------------------------------------------------------------------- Anthropic only

def test_anthropic_refuses_a_fifth_breakpoint() -> None:
    mock = AnthropicCacheMock()
    client = anthropic_client(mock)
    content = [{"type": "text", "text": f"part {index}", "cache_control": {"type": "ephemeral"}} for index in range(5)]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=16, messages=[{"role": "user", "content": content}])


def test_anthropic_caches_only_above_the_models_minimum() -> None:
    case = CASES[1]
    messages = chat(words(100, "s"), words(2000, "d"))
    for model, cached in (("claude-sonnet-4-5", True), ("claude-haiku-4-5", False)):
        mock = AnthropicCacheMock()
        provider_case = Case("anthropic", model, case.make, 0, 0.0)
        provider_case.send(mock, messages)
        assert (provider_case.send(mock, messages).cache_read_tokens > 0) is cached


def test_anthropic_bills_the_one_hour_lifetime_and_keeps_it() -> None:
    clock = ManualClock()
    mock = AnthropicCacheMock(clock=clock)
    case = CASES[1]
    messages = chat(words(100, "s"), words(2000, "d"))
    first = case.send(mock, messages, ttl="1h")
    assert first.cache_write_long_tokens > 0 and first.cache_write_tokens == 0
    clock.advance(1800)
    assert case.send(mock, messages, ttl="1h").cache_read_tokens > 0


def test_anthropic_looks_back_a_bounded_number_of_blocks() -> None:
    """A breakpoint finds an entry written up to twenty blocks before it, not further back."""
    case = CASES[1]
    base = chat("be brief", words(1500, "d"))
    for added, found in ((18, True), (24, False)):
        later = [{"role": "assistant" if index % 2 == 0 else "user", "content": f"turn {index}"}
                 for index in range(added)]
        mock = AnthropicCacheMock()
        case.send(mock, base, placement=CONVERSATION_PLACEMENT)
        usage = case.send(mock, [*base, *later], placement=CONVERSATION_PLACEMENT)
        assert (usage.cache_read_tokens > 0) is found, added


def test_a_streamed_call_reports_the_same_cache_counts(case: Case) -> None:
    """The SDK's own stream reader takes the stand-in's events; its usage matches a plain call's."""
    mock = case.make(ManualClock())
    messages = chat(words(100, "s"), words(2000, "d"))
    case.send(mock, messages)
    body = HostedProvider(HostedSettings(provider=case.name, api_key="test-key")).request(
        {"model": case.model, "messages": messages, "stream": True}).body
    if case.name == "openai":
        chunks = list(openai_client(mock).chat.completions.create(**body, stream_options={"include_usage": True}))
        text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
        usage = parse_hosted_usage(chunks[-1].usage.model_dump())
    else:
        body.pop("stream")
        with anthropic_client(mock).messages.stream(**body) as stream:
            final = stream.get_final_message()
        text = final.content[0].text
        usage = parse_hosted_usage(final.usage.model_dump())
    assert text == "OK."
    assert usage == case.send(mock, messages)
