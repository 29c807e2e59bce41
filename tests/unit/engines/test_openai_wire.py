"""The sans-IO OpenAI wire module: bodies, encoding, usage, and streams read by choice index under any chunking."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.engines.openai_wire import (
    SseLineBuffer,
    StreamState,
    encode_body,
    engine_body,
    is_usage_chunk,
    parse_usage,
    response_text,
    sse_data,
    usage_tokens,
)
from cpmemory.errors import InvalidInputError
from cpmemory.server.sse import SseCollector


def _sse(chunks: list[dict]) -> bytes:
    return ("".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n").encode()


def _interleaved(texts: list[list[str]], usage: bool) -> list[dict]:
    chunks = []
    for position in range(max(len(parts) for parts in texts)):
        for index, parts in enumerate(texts):
            if position < len(parts):
                chunks.append({"choices": [{"index": index, "delta": {"content": parts[position]},
                                            "finish_reason": "stop" if position == len(parts) - 1 else None}]})
    if usage:
        chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}})
    return chunks


def _feed_in_pieces(raw: bytes, cuts: list[int], feed) -> None:
    start = 0
    for position in [*sorted({cut % (len(raw) + 1) for cut in cuts}), len(raw)]:
        feed(raw[start:position])
        start = position


def test_engine_body_replaces_ids_and_salt_and_asks_usage_only_when_streaming() -> None:
    client = {"model": "m", "messages": [{"role": "user", "content": "q"}], "request_id": "x", "cache_salt": "s"}
    plain = engine_body(client, request_id="r1", cache_salt="tenant-salt")
    assert plain.body["request_id"] == "r1" and plain.body["cache_salt"] == "tenant-salt"
    assert "stream_options" not in plain.body and not plain.strip_usage
    streamed = engine_body({**client, "stream": True, "stream_options": {"continuous_usage_stats": False}},
                           request_id="r2", cache_salt="t", messages=[{"role": "user", "content": "ours"}])
    assert streamed.body["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert streamed.strip_usage and streamed.body["messages"] == [{"role": "user", "content": "ours"}]
    asked = engine_body({**client, "stream": True, "stream_options": {"include_usage": True}}, request_id="r",
                        cache_salt=None)
    assert not asked.strip_usage and asked.body["cache_salt"] == "s"  # no salt given: the body is left as is
    assert client == {"model": "m", "messages": [{"role": "user", "content": "q"}], "request_id": "x",
                      "cache_salt": "s"}  # pure


def test_encode_body_turns_every_encoding_error_into_a_typed_error() -> None:
    assert json.loads(encode_body({"a": "é ✓"})) == {"a": "é ✓"}
    for bad in ({"a": "\ud800"}, {"a": [{"b": "x\udfff"}]}, {"\ud800": 1}, {"a": float("nan")}, {"a": object()}):
        with pytest.raises(InvalidInputError) as caught:
            encode_body(bad)
        assert "\ud800" not in str(caught.value) and "\udfff" not in str(caught.value)


def test_usage_and_text_readers_tolerate_missing_parts() -> None:
    assert usage_tokens({}) == (0, 0) and usage_tokens({"usage": {"prompt_tokens": 5}}) == (5, 0)
    assert parse_usage({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}).cached_tokens == 4
    assert parse_usage({"prompt_tokens": True}).prompt_tokens is None
    two = {"choices": [{"index": 1, "message": {"content": "b"}}, {"index": 0, "message": {"content": "a"}}]}
    assert response_text(two) == "a" and response_text(two, 1) == "b" and response_text({"choices": None}) == ""
    assert is_usage_chunk({"choices": [], "usage": {}}) and not is_usage_chunk({"choices": [{}], "usage": {}})
    assert sse_data(b"data: [DONE]\r") == b"[DONE]" and sse_data(b": keep-alive") is None


@settings(max_examples=120, deadline=None)
@given(texts=st.lists(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=5), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_choices_stay_apart_whatever_the_chunking(texts: list[list[str]], cuts: list[int]) -> None:
    raw = _sse(_interleaved(texts, usage=True))
    state, lines = StreamState(), SseLineBuffer()

    def feed(piece: bytes) -> None:
        for line in lines.feed(piece):
            data = sse_data(line)
            if data is not None:
                state.apply_data(data)

    _feed_in_pieces(raw, cuts, feed)
    assert [state.text(index) for index in range(len(texts))] == ["".join(parts) for parts in texts]
    assert state.done and not state.malformed and parse_usage(state.usage).cached_tokens == 3


@settings(max_examples=120, deadline=None)
@given(texts=st.lists(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=5), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 10_000), max_size=10), strip=st.booleans())
def test_collector_relays_the_client_stream_exactly(texts, cuts, strip: bool) -> None:
    """Stripping removes exactly the usage chunk (what the engine sends without include_usage); otherwise the
    bytes pass unchanged. The answer is choice 0's text either way."""
    with_usage, without_usage = _sse(_interleaved(texts, usage=True)), _sse(_interleaved(texts, usage=False))
    collector, relayed = SseCollector(strip_usage=strip), []
    _feed_in_pieces(with_usage, cuts, lambda piece: relayed.append(collector.feed(piece)))
    relayed.append(collector.flush())
    assert b"".join(relayed) == (without_usage if strip else with_usage)
    assert collector.answer == "".join(texts[0]) and collector.complete
    assert collector.usage is not None and collector.usage["prompt_tokens"] == 7


def test_collector_strips_usage_fields_from_chunks_that_carry_choices() -> None:
    raw = _sse([{"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": None},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 1}}])
    relayed = SseCollector(strip_usage=True).feed(raw)
    chunks = [json.loads(line[5:]) for line in relayed.decode().splitlines() if line.startswith("data: {")]
    assert len(chunks) == 2 and all("usage" not in chunk for chunk in chunks)


def test_line_buffer_is_bounded(monkeypatch) -> None:
    from cpmemory.engines import openai_wire

    monkeypatch.setattr(openai_wire, "MAX_LINE_BYTES", 16)
    lines = SseLineBuffer()
    assert lines.feed(b"x" * 20) == [] and lines.overflowed
    assert lines.feed(b"ok\n") == [b"ok"]
