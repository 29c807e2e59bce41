"""The proxy's token budget (issue 13): max_model_len minus max_tokens, counted by the engine's /tokenize."""
from __future__ import annotations

import random

import httpx
import pytest

from cpmemory.core.invariants import check_no_loss
from cpmemory.engines.client import AsyncEngineClient
from cpmemory.server.budget import EngineBudget, model_len, requested_answer_tokens, tighter_budget
from cpmemory.server.schemas import ChatCompletionRequest
from cpmemory.testing.mock_engine import MockEngine, mock_tokenize, render_chatml

WORDS = ["ledger", "harbor", "copper", "violet", "meadow", "signal", "lantern", "orbit", "quartz", "saddle"]


def body(conversation: str, question: str, blocks: list[dict], max_tokens: int = 64) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens, "messages": [{"role": "user", "content": question}],
            "cpmemory": {"conversation_id": conversation, "blocks": blocks}}


def engine_tokens(messages: list[dict]) -> int:
    return len(mock_tokenize(render_chatml(messages)))


@pytest.fixture
async def small_proxy(make_proxy):
    proxy = make_proxy(engine_count=1)
    proxy.engines[0].max_model_len = 4000
    return proxy


async def test_every_turn_fits_the_engine_counted_by_its_tokenize(small_proxy) -> None:
    rng = random.Random(2)
    docs = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(12)]
    for turn in range(25):
        blocks = [{"id": f"d{i}", "text": docs[i]} for i in rng.sample(range(12), 3)]
        response = await small_proxy.client.post("/v1/chat/completions", json=body("long", f"q{turn}", blocks))
        assert response.status_code == 200, response.text
        sent = small_proxy.engines[0].requests[-1]["body"]["messages"]
        assert engine_tokens(sent) <= 4000 - 64  # the mock counts one token per byte: more than the estimate
        assert check_no_loss(blocks, sent).ok
        assert response.json()["cpmemory"]["prompt_budget"] <= 4000 - 64
    metrics = (await small_proxy.client.get("/metrics")).text
    assert 'cpmemory_fallbacks_total{kind="budget_replan"}' in metrics  # the estimate was corrected by /tokenize


async def test_turn_that_cannot_fit_is_a_400_and_stores_nothing(small_proxy) -> None:
    blocks = [{"id": "big", "text": "word " * 1000}]
    response = await small_proxy.client.post("/v1/chat/completions", json=body("big", "q", blocks, max_tokens=100))
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_input"
    state = await small_proxy.service.memory.state("big")
    assert (state.turns, state.open_reservations) == (0, 0)


async def test_engine_without_models_endpoint_gives_no_budget(make_proxy) -> None:
    proxy = make_proxy(engine_count=1)
    proxy.engines[0]._models = lambda request: httpx.Response(404)  # an engine that does not say
    blocks = [{"id": "a", "text": "word " * 2000}]
    response = await proxy.client.post("/v1/chat/completions", json=body("x", "q", blocks))
    assert response.status_code == 200 and response.json()["cpmemory"]["committed"]


def test_helpers() -> None:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    "max_completion_tokens": 300, "max_tokens": 10})
    assert requested_answer_tokens(request, 1024) == 300
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert requested_answer_tokens(plain, 1024) == 1024
    assert model_len({"data": [{"id": "a", "max_model_len": 10}, {"id": "m", "max_model_len": 99}]}, "m") == 99
    assert model_len({"data": []}, "m") is None and model_len({"data": [{"id": "m"}]}, "m") is None
    assert tighter_budget(1000, 900, 1800) <= 900 * 1000 // 1800
    assert 0 < tighter_budget(1000, 2, 10**6) <= 1


async def test_engine_budget_counts_with_tokenize() -> None:
    engine = MockEngine(max_model_len=5000)
    async with AsyncEngineClient("http://engine", transport=engine.transport()) as client:
        budget = EngineBudget(client)
        limits = await budget.limits("tiny")
        assert limits.max_model_len == 5000 and limits.tokenize
        messages = [{"role": "user", "content": "hello"}]
        assert await budget.count("tiny", messages) == engine_tokens(messages)


async def test_with_a_frugal_tokenizer_the_budget_learns_it_and_fills_the_engines_context(make_proxy) -> None:
    """The default counter never under-counts a common tokenizer, so against an engine that needs fewer tokens it
    would cut the history at a fraction of the context. Each answer's usage teaches the budget the engine/planned
    ratio; then conversations fill the engine's context, and never exceed it."""
    proxy = make_proxy(engine_count=1)
    engine = proxy.engines[0]
    engine.max_model_len, engine.token_bytes = 2000, 6
    rng = random.Random(5)
    docs = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(40)]
    largest = 0
    for turn in range(40):
        blocks = [{"id": f"d{i}", "text": docs[i]} for i in rng.sample(range(40), 3)]
        response = await proxy.client.post("/v1/chat/completions", json=body("frugal", f"q{turn}", blocks))
        assert response.status_code == 200, response.text
        sent = engine.requests[-1]["body"]["messages"]
        size = len(engine.tokenize(render_chatml(sent)))
        assert size <= 2000 - 64 and check_no_loss(blocks, sent).ok
        largest = max(largest, size)
    assert largest >= 0.75 * (2000 - 64), largest  # planned in the counter's own tokens: about a third


def test_the_planning_budget_scales_by_the_largest_ratio_once_learnt() -> None:
    budget = EngineBudget(client=None)
    assert budget.planning_budget("m", 1000) == 1000  # nothing learnt yet
    for planned in (600, 800, 1000, 1200, 700, 900, 650):
        budget.learn("m", planned, planned // 2)
    budget.learn("m", 100, 90)  # too short to say anything (the template's tokens)
    assert budget.planning_budget("m", 1000) == 1000  # 7 of 8 learnt
    budget.learn("m", 2000, 1200)  # the largest ratio seen: 0.6
    assert budget.planning_budget("m", 1000) == int(1000 / 0.6 * 0.97)
    assert budget.should_count("m", 801, 1000) and not budget.should_count("m", 799, 1000)  # never assumes < 1


async def test_behind_a_gateway_the_budget_asks_a_replica_itself_when_the_replicas_are_given() -> None:
    from cpmemory.routing.transport import HttpxChatTransport
    from cpmemory.server.app import ServerConfig, create_app

    transport = HttpxChatTransport()
    behind = create_app(ServerConfig(upstream="http://gateway:8000", engines=["http://e0:8000", "http://e1:8000"]),
                        transport=transport)
    assert behind.state.service.engine_budget.client.base_url == "http://e0:8000"  # not one more request to route
    alone = create_app(ServerConfig(upstream="http://gateway:8000"), transport=transport)
    assert alone.state.service.engine_budget.client.base_url == "http://gateway:8000"
    await transport.aclose()


async def test_a_prompt_whose_bytes_fit_the_budget_is_sent_without_a_count_even_before_the_ratio_is_learnt(
        make_proxy) -> None:
    """A freshly started proxy knows no engine/planned ratio yet: it counted every long prompt with ``/tokenize``
    (a burst of them queued at the engine's API server). A prompt whose UTF-8 bytes plus the template's tokens per
    message fit the budget cannot exceed it (the mock, like any byte-level tokenizer, never counts more than a token
    a byte): it is not counted. A longer one still is, and still fits."""
    proxy = make_proxy(engine_count=1)
    engine = proxy.engines[0]
    engine.max_model_len = 16_000
    tokenized: list[int] = []
    original = engine._tokenize

    def counting(request):  # type: ignore[no-untyped-def]
        tokenized.append(1)
        return original(request)

    engine._tokenize = counting
    rng = random.Random(7)
    doc = " ".join(rng.choice(WORDS) for _ in range(1900))  # ~13,300 bytes: the estimate plans ~7,000 tokens
    response = await proxy.client.post("/v1/chat/completions", json=body("fits", "q", [{"id": "d", "text": doc}]))
    assert response.status_code == 200, response.text
    startup = len(tokenized)  # the limits' one-word probe
    assert startup == 1
    for turn in range(3):  # unlearned ratio 2 x slack 1.25 x ~7,000 planned > 16,000: counted before the bound
        blocks = [{"id": f"e{turn}", "text": " ".join(rng.choice(WORDS) for _ in range(1900))}]
        response = await proxy.client.post("/v1/chat/completions", json=body(f"fits{turn}", "q", blocks))
        assert response.status_code == 200, response.text
    assert len(tokenized) == startup
    engine.token_bytes = 2  # a frugal tokenizer: prompts of more bytes than the budget may fit; the engine says
    big = [{"id": f"big{i}", "text": " ".join(rng.choice(WORDS) for _ in range(900))} for i in range(3)]
    response = await proxy.client.post("/v1/chat/completions", json=body("big", "q", big))  # ~19,000 bytes
    assert response.status_code == 200, response.text
    assert len(tokenized) > startup
    assert len(engine.tokenize(render_chatml(engine.requests[-1]["body"]["messages"]))) <= 16_000 - 64


def test_the_byte_bound_covers_only_text_messages() -> None:
    from cpmemory.server.budget import EngineLimits

    limits = EngineLimits(4096, True, 0.0, template_tokens=9)
    text = [{"role": "system", "content": "abc"}, {"role": "user", "content": "héllo"}]
    assert limits.upper_bound(text) == 3 + 6 + 2 * 9
    assert limits.upper_bound([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]) \
        is None  # an image's tokens are not in any bytes
    assert limits.upper_bound([{"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}]) is None
    assert EngineLimits(4096, True, 0.0).upper_bound(text) is None  # the template was not counted
    budget = EngineBudget(client=None)
    assert not budget.should_count("m", 5000, 1000, upper_bound=1000)  # the bound fits: whatever the estimate
    assert budget.should_count("m", 5000, 1000, upper_bound=1001)


async def test_concurrent_first_requests_ask_the_engine_for_its_limits_once() -> None:
    """A burst reaching a fresh proxy: every request needs the model's limits; one check serves them all."""
    import asyncio

    engine = MockEngine(max_model_len=5000)
    asked = {"models": 0, "tokenize": 0}
    models, tokenize = engine._models, engine._tokenize

    def counted(name, handler):  # type: ignore[no-untyped-def]
        def call(request):  # type: ignore[no-untyped-def]
            asked[name] += 1
            return handler(request)
        return call

    engine._models, engine._tokenize = counted("models", models), counted("tokenize", tokenize)

    class Slow(httpx.AsyncBaseTransport):  # an engine busy with the burst: each answer takes a while
        def __init__(self) -> None:
            self.inner = engine.transport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            for _ in range(20):  # the other callers run meanwhile
                await asyncio.sleep(0)
            return await self.inner.handle_async_request(request)

    async with AsyncEngineClient("http://engine", transport=Slow()) as client:
        budget = EngineBudget(client)
        answers = await asyncio.gather(*(budget.limits("tiny") for _ in range(20)))
        assert {a.max_model_len for a in answers} == {5000} and all(a.tokenize for a in answers)
        assert asked == {"models": 1, "tokenize": 1}
        await budget.limits("tiny")
        assert asked == {"models": 1, "tokenize": 1}  # remembered
