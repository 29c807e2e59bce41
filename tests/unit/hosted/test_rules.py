"""The sans-IO provider rules: OpenAI cache keys, Anthropic bodies and breakpoints, prices and usage."""
from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.errors import InvalidInputError
from cpmemory.hosted import CPMEMORY_PLACEMENT, MAX_BREAKPOINTS, Price, PriceTable
from cpmemory.hosted.anthropic_body import anthropic_request, count_breakpoints, openai_response
from cpmemory.hosted.openai_body import conversation_cache_key, openai_request, prefix_cache_key
from cpmemory.hosted.prices import HostedUsage, parse_hosted_usage


def test_a_conversations_turns_share_one_prefix_key() -> None:
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "[D1]\nblock\n\nQuestion: one"}]
    later = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "Question: two"}]
    other = [{"role": "system", "content": "s"}, {"role": "user", "content": "[D2]\nblock\n\nQuestion: one"}]
    assert prefix_cache_key(first) == prefix_cache_key(later) != prefix_cache_key(other)
    assert conversation_cache_key("t", "c") != conversation_cache_key("t", "d")
    assert "alice-chat" not in conversation_cache_key("tenant", "alice-chat")  # no user data in clear


def test_openai_body_keeps_a_client_key_and_strips_engine_fields() -> None:
    body = openai_request({"model": "m", "messages": [], "prompt_cache_key": "mine", "cache_salt": "x",
                           "priority": 3}, cache_key="ours", model="gpt-5")
    assert body == {"model": "gpt-5", "messages": [], "prompt_cache_key": "mine"}


def chat(history_turns: int, system: bool = True, question: bool = True) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "rules"}] if system else []
    for index in range(history_turns):
        messages += [{"role": "user", "content": f"q{index}"}, {"role": "assistant", "content": f"a{index}"}]
    messages.append({"role": "user", "content": "[D1]\ndoc\n\nQuestion: why?" if question else "why?"})
    return {"model": "claude-sonnet-4-5", "messages": messages}


def marked(body: dict[str, Any]) -> list[str]:
    blocks = list(body.get("system", [])) + [block for message in body["messages"] for block in message["content"]]
    return [block["text"] for block in blocks if "cache_control" in block]


def test_breakpoints_go_to_system_history_context_and_prompt_end() -> None:
    body = anthropic_request(chat(2))
    assert marked(body) == ["rules", "a1", "[D1]\ndoc", "\n\nQuestion: why?"]
    assert body["max_tokens"] == 1024 and body["system"][0]["text"] == "rules"


def test_a_placement_names_only_the_breakpoints_it_wants() -> None:
    assert marked(anthropic_request(chat(1), placement=("system", "final"))) == ["rules", "\n\nQuestion: why?"]
    assert marked(anthropic_request(chat(0, system=False, question=False))) == ["why?"]
    assert marked(anthropic_request(chat(1), placement=())) == []


def test_a_lifetime_is_written_on_every_breakpoint() -> None:
    body = anthropic_request(chat(1), ttl="1h")
    markers = [block["cache_control"] for message in body["messages"] for block in message["content"]
               if "cache_control" in block]
    assert markers and all(marker == {"type": "ephemeral", "ttl": "1h"} for marker in markers)


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": []},
    {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2},
    {"model": "m", "messages": [{"role": "assistant", "content": "x"}]},
])
def test_what_cannot_be_translated_is_a_typed_error(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidInputError):
        anthropic_request(body)


message_text = st.text(alphabet="ab \n", min_size=1, max_size=30)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": message_text})


@settings(max_examples=200, deadline=None)
@given(st.lists(message, min_size=1, max_size=30), st.lists(st.sampled_from(CPMEMORY_PLACEMENT), max_size=6))
def test_never_more_breakpoints_than_anthropic_allows(messages: list[dict[str, str]], placement: list[str]) -> None:
    system = [item for item in messages if item["role"] == "system"]
    rest = [item for item in messages if item["role"] != "system"]
    if not rest or rest[0]["role"] != "user":
        rest.insert(0, {"role": "user", "content": "start"})
    body = anthropic_request({"model": "m", "messages": system + rest}, placement=placement)
    assert count_breakpoints(body) <= MAX_BREAKPOINTS
    roles = [item["role"] for item in body["messages"]]
    assert all(a != b for a, b in itertools.pairwise(roles))  # one role's consecutive messages are merged


def test_an_anthropic_answer_reads_as_an_openai_completion() -> None:
    answer = openai_response({"id": "msg_1", "model": "claude-sonnet-4-5", "stop_reason": "max_tokens",
                              "content": [{"type": "text", "text": "hi"}],
                              "usage": {"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": 1000,
                                        "cache_creation_input_tokens": 200}}, created=7)
    assert answer["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "hi"},
                                    "finish_reason": "length"}
    assert answer["usage"]["prompt_tokens"] == 1210 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 1000
    assert parse_hosted_usage(answer["usage"]) == HostedUsage(1210, 1000, 200, 0, 2)


def test_usage_of_either_provider_parses_and_prices() -> None:
    openai_usage = parse_hosted_usage({"prompt_tokens": 2000, "completion_tokens": 5,
                                       "prompt_tokens_details": {"cached_tokens": 1536}})
    assert openai_usage == HostedUsage(2000, 1536, 0, 0, 5) and openai_usage.uncached_tokens == 464
    anthropic_usage = parse_hosted_usage({"input_tokens": 50, "output_tokens": 3, "cache_read_input_tokens": 900,
                                          "cache_creation_input_tokens": 300,
                                          "cache_creation": {"ephemeral_1h_input_tokens": 100}})
    assert anthropic_usage == HostedUsage(1250, 900, 200, 100, 3)
    price = Price(input=3.0, cache_read=0.3, cache_write=3.75, cache_write_long=6.0)
    assert anthropic_usage.input_cost(price) == pytest.approx((50 * 3 + 900 * 0.3 + 200 * 3.75 + 100 * 6) / 1e6)
    assert parse_hosted_usage(None) == HostedUsage(0)


def test_prices_match_a_dated_model_and_take_overrides() -> None:
    table = PriceTable()
    assert table.find("claude-sonnet-4-5-20250929") == table.find("claude-sonnet-4-5")
    assert table.find("unknown-model") is None
    cheaper = table.with_overrides({"gpt-5": {"input": 1.0}, "local": {"input": 1, "cache_read": 0,
                                                                       "cache_write": 1, "cache_write_long": 1}})
    assert cheaper.find("gpt-5").input == 1.0 and cheaper.find("gpt-5").cache_read == table.find("gpt-5").cache_read
    assert cheaper.find("local") is not None and table.find("local") is None
    with pytest.raises(InvalidInputError):
        table.with_overrides({"gpt-5": {"input": -1.0}})
    with pytest.raises(InvalidInputError):
        table.with_overrides({"new-model": {"input": 1.0}})
