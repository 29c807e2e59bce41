"""Issue 16 reproducers through the proxy (ASGI, mock engines): every block and message reaches the engine."""
from __future__ import annotations

from cpmemory.core.invariants import check_no_loss

HARBOR = {"id": "a", "text": "The harbor opens at nine."}
MUSEUM = {"id": "a", "text": "The museum closes at five."}


def body(messages: list[dict], blocks: list[dict], query: str | None = None) -> dict:
    extension: dict = {"conversation_id": "c1", "blocks": blocks}
    if query is not None:
        extension["query"] = query
    return {"model": "tiny", "max_tokens": 8, "messages": messages, "cpmemory": extension}


async def _send(proxy, payload: dict) -> tuple[dict, list[dict]]:
    response = await proxy.client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 200, response.text
    return response.json(), proxy.engine_of(response.json()).requests[-1]["body"]["messages"]


async def test_item1_repeated_id_with_other_text_reaches_the_engine(proxy) -> None:
    answer, sent = await _send(proxy, body([{"role": "user", "content": "When?"}], [HARBOR, MUSEUM]))
    assert HARBOR["text"] in sent[-1]["content"] and MUSEUM["text"] in sent[-1]["content"]
    assert [d["status"] for d in answer["cpmemory"]["decisions"]] == ["new", "new"]
    assert check_no_loss([HARBOR, MUSEUM], sent).ok


async def test_item4_tool_calls_names_and_parts_reach_the_engine_unchanged(proxy) -> None:
    history = [
        {"role": "user", "content": "Multiply 6 by 7.", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "mul", "arguments": "{\"a\": 6, \"b\": 7}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "mul", "content": "42"},
        {"role": "assistant", "content": [{"type": "text", "text": "It is 42."}]},
    ]
    messages = [{"role": "system", "content": "Be brief."}, *history, {"role": "user", "content": "Why?"}]
    _, sent = await _send(proxy, body(messages, [HARBOR]))
    assert sent[1:-1] == history
    report = check_no_loss([HARBOR], sent, caller_messages=messages, query="Why?")
    assert report.ok, report.violations


async def test_item5_the_query_extension_never_drops_the_last_user_message(proxy) -> None:
    messages = [{"role": "user", "content": "Answer in French, max 20 words."}]
    blocks = [{"id": "b", "text": "The board approved the budget on Monday."}]
    _, sent = await _send(proxy, body(messages, blocks, query="Who approved the budget?"))
    assert any(m["content"] == "Answer in French, max 20 words." for m in sent)
    report = check_no_loss(blocks, sent, caller_messages=messages, query="Who approved the budget?")
    assert report.ok, report.violations


async def test_items6_to_8_a_stream_with_two_choices_stores_choice_0_and_the_next_turn_loses_nothing(proxy) -> None:
    # items 6-8 are engineer wire's (tests/unit/server/test_stream_and_encoding.py); this checks the next prompt whole
    for engine in proxy.engines:
        engine.reply = lambda _body: "Alpha Beta Gamma"
    first = body([{"role": "user", "content": "Which?"}], [HARBOR])
    streamed = await proxy.client.post("/v1/chat/completions", json={**first, "stream": True, "n": 2})
    assert streamed.status_code == 200 and b'"usage"' not in streamed.content
    follow = [{"role": "user", "content": "And then?"}]
    _, sent = await _send(proxy, body(follow, [HARBOR, MUSEUM]))
    assert [m["content"] for m in sent if m["role"] == "assistant"] == ["Alpha Beta Gamma"]
    report = check_no_loss([HARBOR, MUSEUM], sent, caller_messages=follow, query="And then?")
    assert report.ok, report.violations
