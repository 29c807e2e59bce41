"""The served mock engine (``cpmemory mock-engine``) over ASGI: what OpenAI clients and the proxy ask of it."""
from __future__ import annotations

import httpx

from cpmemory.testing.mock_engine import MockEngine
from cpmemory.testing.mock_server import build_app, describe_prompt


async def test_the_served_mock_answers_models_chat_streams_and_unknown_paths() -> None:
    engine = MockEngine(model="served", max_model_len=4096, records=2)
    engine.reply = describe_prompt(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://m") as client:
        listed = (await client.get("/v1/models")).json()
        assert listed["data"][0]["id"] == "served" and listed["data"][0]["max_model_len"] == 4096
        body = {"model": "served", "messages": [{"role": "user", "content": "x" * 100}]}
        first = (await client.post("/v1/chat/completions", json=body)).json()
        again = (await client.post("/v1/chat/completions", json=body)).json()
        answer = first["choices"][0]["message"]["content"]
        assert f"1 message and {first['usage']['prompt_tokens']} tokens" in answer
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert (await client.get("/nothing")).status_code == 404
    assert len(engine.requests) == 2 and engine.requests[-1]["request_id"] == "mock-2"  # the latest kept
