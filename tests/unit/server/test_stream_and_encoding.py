"""Issue 16 items 6-8 through the proxy: ``n > 1`` streams keep choices apart and commit choice 0; text that cannot
be encoded is a 400 that aborts the turn; a stream relays only what the client asked for (no unrequested usage)."""
from __future__ import annotations

import json

import pytest

from cpmemory.types import ConversationKey

BLOCKS_1 = [{"id": f"doc-{i}", "text": f"Document {i}: " + f"fact {i} about the topic. " * 20} for i in range(4)]


def turn_body(conversation: str, question: str, blocks: list[dict], stream: bool = False) -> dict:
    return {"model": "tiny", "stream": stream, "max_tokens": 8,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
            "cpmemory": {"conversation_id": conversation, "blocks": blocks}}


def _events(raw: bytes) -> list[dict]:
    """The JSON chunks of an SSE body (``[DONE]`` left out)."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


async def _open_reservations(proxy, conversation: str) -> int:
    state = await proxy.service.memory.store.load(ConversationKey("default", conversation))
    return state.open_reservations


async def test_stream_with_two_choices_keeps_them_apart_and_commits_choice_0(proxy) -> None:
    body = {**turn_body("n2", "Which fact?", BLOCKS_1, stream=True), "n": 2}
    body["cpmemory"]["blocks"] = [{"id": "d", "text": "One document about the harbor. " * 8}]
    for engine in proxy.engines:
        engine.reply = lambda _body: "Alpha Beta Gamma"
    streamed = await proxy.client.post("/v1/chat/completions", json=body)
    assert streamed.status_code == 200, streamed.text
    texts: dict[int, str] = {}
    for chunk in _events(streamed.content):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert texts == {0: "Alpha Beta Gamma", 1: "Alpha Beta Gamma #1"}  # relayed as the engine sent them
    follow = await proxy.client.post("/v1/chat/completions", json=turn_body("n2", "And then?", []))
    assert follow.status_code == 200, follow.text
    sent = proxy.engine_of(follow.json()).requests[-1]["body"]["messages"]
    answers = [message["content"] for message in sent if message["role"] == "assistant"]
    assert answers == ["Alpha Beta Gamma"]  # the stored answer is choice 0 alone, never a mix of choices


@pytest.mark.parametrize("where", ["history", "system", "query"])
@pytest.mark.parametrize("stream", [False, True])
async def test_lone_surrogate_is_a_400_and_leaves_no_reservation(proxy, where: str, stream: bool) -> None:
    conversation = f"surrogate-{where}-{stream}"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "earlier question"}, {"role": "assistant", "content": "earlier answer"},
                {"role": "user", "content": "Which fact?"}]
    marker = "SURROGATE"
    if where == "history":
        messages[2]["content"] = f"{marker} answer"
    elif where == "system":
        messages[0]["content"] = f"{marker} be brief"
    else:
        messages[3]["content"] = f"{marker} which fact?"
    body = {"model": "tiny", "stream": stream, "messages": messages,
            "cpmemory": {"conversation_id": conversation, "blocks": BLOCKS_1[:2]}}
    raw = json.dumps(body).replace(marker, "\\ud800").encode()  # a lone surrogate, as JSON allows it
    sent_before = sum(len(engine.requests) for engine in proxy.engines)
    response = await proxy.client.post("/v1/chat/completions", content=raw,
                                       headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert await _open_reservations(proxy, conversation) == 0
    assert sum(len(engine.requests) for engine in proxy.engines) == sent_before  # nothing reached an engine
    again = await proxy.client.post("/v1/chat/completions", json=turn_body(conversation, "Which fact?", BLOCKS_1))
    assert again.status_code == 200 and again.json()["cpmemory"]["turn"] == 1  # the aborted turn left no trace


async def test_lone_surrogate_in_a_plain_request_is_a_400(proxy) -> None:
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
    response = await proxy.client.post("/v1/chat/completions", content=raw,
                                       headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("cpmemory_turn", [True, False])
async def test_stream_relays_no_usage_the_client_did_not_ask_for(proxy, cpmemory_turn: bool) -> None:
    body = turn_body("u1", "Which fact?", BLOCKS_1, stream=True)
    if not cpmemory_turn:
        body.pop("cpmemory")
    streamed = await proxy.client.post("/v1/chat/completions", json=body)
    assert streamed.status_code == 200, streamed.text
    chunks = _events(streamed.content)
    assert chunks and all(chunk["choices"] for chunk in chunks)  # `chunk.choices[0]` works for every chunk
    assert all("usage" not in chunk for chunk in chunks)
    assert streamed.content.endswith(b"data: [DONE]\n\n") and b"\n\n\n" not in streamed.content
    sent = proxy.fleet.calls[-1][1]
    assert sent["stream_options"] == {"include_usage": True}  # the proxy still asks, for its own metrics
    metrics = (await proxy.client.get("/metrics")).text
    prompt_tokens = [line for line in metrics.splitlines() if line.startswith("cpmemory_engine_prompt_tokens_total")]
    assert prompt_tokens and float(prompt_tokens[0].split()[1]) > 0


async def test_stream_relays_usage_when_the_client_asks(proxy) -> None:
    body = {**turn_body("u2", "Which fact?", BLOCKS_1, stream=True), "stream_options": {"include_usage": True}}
    streamed = await proxy.client.post("/v1/chat/completions", json=body)
    chunks = _events(streamed.content)
    usage = [chunk for chunk in chunks if chunk["choices"] == []]
    assert len(usage) == 1 and usage[0]["usage"]["prompt_tokens"] > 0
