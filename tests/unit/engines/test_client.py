"""EngineClient / AsyncEngineClient against the in-process mock engine, and the sans-IO parsers."""
from __future__ import annotations

import httpx
import pytest

from cpmemory.engines.client import (
    AsyncEngineClient,
    EngineClient,
    EngineSettings,
    EngineStatusError,
    StreamAccumulator,
    metric_total,
    parse_cache_config,
    parse_chat_response,
    parse_metrics,
    parse_tokenize,
)
from cpmemory.errors import EngineError
from cpmemory.testing.mock_engine import MockEngine, mock_tokenize, render_chatml

LONG = "The quick brown fox jumps over the lazy dog. " * 8


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": LONG}, {"role": "user", "content": question}]


@pytest.fixture()
def engine() -> MockEngine:
    return MockEngine(block_size=16, capacity_blocks=256)


@pytest.fixture()
def client(engine):
    with EngineClient(EngineSettings(base_url="http://mock", timeout_s=2), transport=engine.transport()) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reports_cached_tokens_and_sends_request_id(engine, client, stream):
    first = client.chat(messages("one?"), request_id="req-1", cache_salt="tenant-a", stream=stream)
    second = client.chat(messages("two?"), request_id="req-2", cache_salt="tenant-a", stream=stream)
    assert first.cached_tokens == 0
    prompt_tokens = len(mock_tokenize(render_chatml(messages("two?"))))
    assert second.prompt_tokens == prompt_tokens
    assert 0 < second.cached_tokens < prompt_tokens
    shared = len(mock_tokenize(render_chatml([messages("x")[0]], add_generation_prompt=False))) + len("<|im_start|>user\n")
    assert second.cached_tokens == (shared // 16) * 16
    assert (second.ttft_s is not None) == stream
    assert second.content == "ok" and second.request_id == "req-2"
    sent = engine.requests[-1]
    assert sent["request_id"] == "req-2" and sent["body"]["request_id"] == "req-2"
    assert sent["body"]["cache_salt"] == "tenant-a"
    if stream:
        assert sent["body"]["stream_options"] == {"include_usage": True}


def test_cache_salt_isolates_tenants(client):
    client.chat(messages("q"), cache_salt="tenant-a")
    assert client.chat(messages("q"), cache_salt="tenant-b").cached_tokens == 0


def test_error_status_is_typed(engine, client):
    engine.fail_next(1, status=503)
    with pytest.raises(EngineStatusError) as caught:
        client.chat(messages("q"))
    assert caught.value.status_code == 503
    engine.fail_next(1, status=400)
    with pytest.raises(EngineStatusError):
        client.chat(messages("q"), stream=True)
    assert client.chat(messages("q")).content == "ok"


def test_timeout_and_connection_failures_become_engine_errors(engine, client):
    engine.hang_next()
    with pytest.raises(EngineError, match="timed out"):
        client.chat(messages("q"), stream=True)
    engine.down = True
    with pytest.raises(EngineError, match="unreachable"):
        client.chat(messages("q"))
    assert client.health() is False
    engine.down = False
    assert client.health() is True


def test_real_timeout_against_a_silent_server():
    import socket

    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        settings = EngineSettings(base_url=url, timeout_s=0.3, connect_timeout_s=0.3)
        with EngineClient(settings) as silent, pytest.raises(EngineError, match="timed out"):
            silent.chat(messages("q"))


def test_tokenize_metrics_and_reset(engine, client):
    tokens = client.tokenize(messages("q"))
    assert tokens == mock_tokenize(render_chatml(messages("q")))
    assert client.tokenize(prompt="abc") == mock_tokenize("abc")
    config = client.cache_config()
    assert (config.block_size, config.hash_algorithm, config.num_blocks) == (16, "sha256", 256)
    client.chat(messages("q"))
    assert engine.cached_blocks()
    assert client.reset_prefix_cache() is True
    assert engine.cached_blocks() == []
    engine.fail_next(1, status=404)
    assert client.reset_prefix_cache() is False


def test_non_json_answer_is_an_engine_error():
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text="<html>"))
    with EngineClient("http://x", transport=transport) as broken:
        with pytest.raises(EngineError, match="non-JSON"):
            broken.chat(messages("q"))
        with pytest.raises(EngineError, match="non-JSON"):
            broken.tokenize(prompt="a")


async def test_async_client_matches_sync(engine):
    async with AsyncEngineClient("http://mock", transport=engine.transport()) as client:
        first = await client.chat(messages("a"), request_id="a1", stream=True)
        second = await client.chat(messages("b"), request_id="a2")
        assert first.cached_tokens == 0 and second.cached_tokens > 0
        assert await client.tokenize(messages("a")) == mock_tokenize(render_chatml(messages("a")))
        assert (await client.cache_config()).block_size == 16
        assert await client.health() is True
        assert await client.reset_prefix_cache() is True
        engine.fail_next(1, status=500)
        with pytest.raises(EngineStatusError):
            await client.chat(messages("a"), stream=True)
        engine.hang_next()
        with pytest.raises(EngineError, match="timed out"):
            await client.chat(messages("a"))


def test_stream_accumulator_handles_errors_and_empty_first_token():
    accumulator = StreamAccumulator("r", started=0.0)
    assert accumulator.feed_line(": keep-alive", 0.1) is None
    accumulator.feed_line('data: {"id": "c", "choices": [{"delta": {"role": "assistant"}}]}', 0.2)
    assert accumulator.first_token_at is None
    accumulator.feed_line('data: {"choices": [{"delta": {"content": ""}, "finish_reason": "length"}]}', 0.3)
    accumulator.feed_line('data: {"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": null}}', 0.4)
    accumulator.feed_line("data: [DONE]", 0.5)
    result = accumulator.result(0.6)
    assert result.ttft_s == pytest.approx(0.3) and result.prompt_tokens == 5 and result.cached_tokens is None
    assert accumulator.done
    with pytest.raises(EngineError):
        accumulator.feed_line("data: {not json", 0.7)
    with pytest.raises(EngineError, match="engine error"):
        accumulator.feed_line('data: {"error": {"message": "boom"}}', 0.7)


def test_parsers_reject_malformed_payloads():
    with pytest.raises(EngineError):
        parse_chat_response({"choices": []}, request_id="r", total_s=0.0)
    with pytest.raises(EngineError):
        parse_tokenize({"tokens": ["a"]})
    with pytest.raises(EngineError):
        parse_cache_config("vllm:other 1\n")


def test_metrics_parsing_of_vllm_text():
    text = (
        "# HELP vllm:prefix_cache_hits_total hits\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 896.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 4.0\n'
        'vllm:cache_config_info{block_size="128",enable_prefix_caching="True",num_gpu_blocks="None",'
        'prefix_caching_hash_algo="sha256_cbor",sliding_window="None"} 1.0\n'
    )
    samples = parse_metrics(text)
    assert metric_total(samples, "vllm:prefix_cache_hits_total") == 900.0
    assert metric_total(samples, "absent") is None
    config = parse_cache_config(text)
    assert (config.block_size, config.hash_algorithm, config.num_blocks) == (128, "sha256_cbor", None)


def test_sglang_style_request_id_field(engine):
    settings = EngineSettings(base_url="http://mock", request_id_fields=("rid",))
    with EngineClient(settings, transport=engine.transport()) as client:
        client.chat(messages("q"), request_id="sg-1")
    body = engine.requests[-1]["body"]
    assert body["rid"] == "sg-1" and "request_id" not in body
    assert engine.requests[-1]["request_id"] == "sg-1"  # the X-Request-Id header


def test_reset_is_retried_while_the_engine_reports_busy(engine, client):
    client.chat(messages("q"))
    engine.refuse_resets(2)
    assert client.reset_prefix_cache(wait_s=0.0) is True
    assert engine.cached_blocks() == []
    client.chat(messages("q"))
    engine.refuse_resets(5)
    assert client.reset_prefix_cache(attempts=3, wait_s=0.0) is False
    assert engine.cached_blocks() != []
