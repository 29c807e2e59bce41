"""OpenAI clients resend the whole conversation on every call: through the proxy, with the real ``openai`` SDK, a
client that sends its history gets the prompts (byte for byte), the de-duplication and the cached prefix of a client
that sends only the new message; a history that is not the conversation's is sent as given and reported.

The MT-RAG replay (``test_mt_rag_replay_resending_history_matches_new_message_only``) reads ``../shared/data`` and
prints both figures; run it alone with ``-s`` to see them.
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from cpmemory.core.invariants import check_no_loss
from tests.unit.server.conftest import Proxy

openai = pytest.importorskip("openai")

SYSTEM = {"role": "system", "content": "Answer from the documents."}


@dataclass
class Replay:
    """What a replay saw: the engine prompts, the figures, and how each history was used."""

    prompts: list[list[dict[str, Any]]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    deduplicated: int = 0
    lost: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)

    def figures(self) -> str:
        share = self.cached_tokens / max(1, self.prompt_tokens)
        return (f"prompt tokens {self.prompt_tokens}, cached {self.cached_tokens} ({share:.1%}), "
                f"deduplicated {self.deduplicated}, lost {self.lost}, history {dict(self.outcomes)}")


def sdk_client(proxy: Proxy) -> Any:
    """The real ``openai`` SDK talking to the proxy app in process."""
    transport = httpx.ASGITransport(app=proxy.app)
    return openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="unused",
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://proxy"))


Turn = tuple[str, Sequence[dict[str, str]]]  # (question, blocks)


async def replay(proxy: Proxy, conversations: dict[str, list[Turn]], resend: bool) -> Replay:
    """Run the conversations turn by turn, round robin; ``resend``: each call carries the client's whole history
    (the plain questions and the answers, as an SDK user keeps them), else only the new message."""
    client = sdk_client(proxy)
    seen = Replay()
    histories: dict[str, list[dict[str, str]]] = {name: [] for name in conversations}
    rounds = itertools.zip_longest(*conversations.values())
    try:
        for turns in rounds:
            for name, turn in zip(conversations, turns):
                if turn is None:
                    continue
                question, blocks = turn
                history = histories[name] if resend else []
                response = await client.chat.completions.create(
                    model="tiny", max_tokens=8, messages=[SYSTEM, *history, {"role": "user", "content": question}],
                    extra_body={"cpmemory": {"conversation_id": name, "blocks": list(blocks)}},
                )
                info = response.model_extra["cpmemory"]
                sent = proxy.engines[info["replica"]].requests[-1]["body"]["messages"]
                seen.prompts.append(sent)
                seen.lost += not check_no_loss(blocks, sent).ok
                seen.prompt_tokens += response.usage.prompt_tokens
                seen.cached_tokens += response.usage.prompt_tokens_details.cached_tokens
                seen.deduplicated += info["tokens_deduplicated"]
                seen.outcomes[info["history"]] += 1
                answer = response.choices[0].message.content
                histories[name] += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    finally:
        await client.close()
    return seen


def synthetic(conversations: int, turns: int) -> dict[str, list[Turn]]:
    pool = [{"id": f"doc-{i}", "text": f"Document {i}. " + f"Fact {i} about the subject, in detail. " * 12}
            for i in range(12)]
    return {f"c{c}": [(f"Question {t} of {c}?", [pool[(c + t + k) % 12] for k in range(4)]) for t in range(turns)]
            for c in range(conversations)}


async def test_resending_history_gives_the_same_prompts_as_new_message_only(make_proxy) -> None:
    conversations = synthetic(3, 4)
    only_new = await replay(make_proxy(), conversations, resend=False)
    resent = await replay(make_proxy(), conversations, resend=True)
    assert resent.prompts == only_new.prompts  # byte for byte: blocks, references, annotations, cached prefix
    assert (resent.cached_tokens, resent.deduplicated) == (only_new.cached_tokens, only_new.deduplicated)
    assert only_new.deduplicated > 0 and only_new.cached_tokens > 0 and resent.lost == only_new.lost == 0
    assert resent.outcomes == {"none": 3, "matched": 9} and only_new.outcomes == {"none": 12}


async def test_user_messages_as_sent_match_too(make_proxy) -> None:
    proxy = make_proxy()
    blocks = synthetic(1, 1)["c0"][0][1]
    body = {"model": "tiny", "max_tokens": 8, "messages": [SYSTEM, {"role": "user", "content": "first?"}],
            "cpmemory": {"conversation_id": "x", "blocks": blocks}}
    first = (await proxy.client.post("/v1/chat/completions", json=body)).json()
    sent = proxy.engine_of(first).requests[-1]["body"]["messages"]
    answer = first["choices"][0]["message"]["content"]
    body["messages"] = [*sent, {"role": "assistant", "content": answer}, {"role": "user", "content": "second?"}]
    second = (await proxy.client.post("/v1/chat/completions", json=body)).json()
    assert second["cpmemory"]["history"] == "matched"
    again = proxy.engine_of(second).requests[-1]["body"]["messages"]
    assert again[: len(sent)] == sent and {d["status"] for d in second["cpmemory"]["decisions"]} == {"referenced"}


@pytest.mark.parametrize("edit", ["answer", "truncated", "other", "tool"])
async def test_a_history_that_is_not_the_conversation_is_sent_as_given(make_proxy, edit: str) -> None:
    proxy = make_proxy()
    blocks = synthetic(1, 1)["c0"][0][1]
    body = {"model": "tiny", "max_tokens": 8, "messages": [SYSTEM, {"role": "user", "content": "first?"}],
            "cpmemory": {"conversation_id": "x", "blocks": blocks}}
    first = (await proxy.client.post("/v1/chat/completions", json=body)).json()
    answer = first["choices"][0]["message"]["content"]
    history = {
        "answer": [{"role": "user", "content": "first?"}, {"role": "assistant", "content": answer + " (edited)"}],
        "truncated": [{"role": "assistant", "content": answer}],
        "other": [{"role": "user", "content": "another?"}, {"role": "assistant", "content": answer}],
        "tool": [{"role": "user", "content": "first?"},
                 {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "t1", "content": "result"},
                 {"role": "assistant", "content": answer}],
    }[edit]
    body["messages"] = [SYSTEM, *history, {"role": "user", "content": "second?"}]
    second = await proxy.client.post("/v1/chat/completions", json=body)
    assert second.status_code == 200, second.text
    assert second.json()["cpmemory"]["history"] == "diverged"
    sent = proxy.engine_of(second.json()).requests[-1]["body"]["messages"]
    assert sent[1:-1] == history and check_no_loss(blocks, sent).ok
    metrics = (await proxy.client.get("/metrics")).text
    assert 'cpmemory_history_reconciled_total{outcome="diverged"} 1.0' in metrics
    assert 'cpmemory_history_reconciled_total{outcome="none"} 1.0' in metrics


def mt_rag_conversations(count: int) -> dict[str, list[Turn]]:
    from cpmemory.bench.loaders import default_data_dir, load_mt_rag

    data = default_data_dir()
    if not (data / "mt_rag").is_dir():
        pytest.skip(f"MT-RAG data not found under {data}")
    by_session: dict[str, list[Turn]] = {}
    for request in load_mt_rag(data).requests:
        if request.session in by_session or len(by_session) < count:
            blocks = [{"id": block.id, "text": block.text} for block in request.blocks]
            by_session.setdefault(request.session, []).append((request.query, blocks))
    return by_session


async def test_mt_rag_replay_resending_history_matches_new_message_only(make_proxy) -> None:
    conversations = mt_rag_conversations(6)
    only_new = await replay(make_proxy(), conversations, resend=False)
    resent = await replay(make_proxy(), conversations, resend=True)
    print(f"\nMT-RAG, {len(conversations)} conversations, {len(only_new.prompts)} turns each way, mock engine")
    print(f"  new message only: {only_new.figures()}")
    print(f"  whole history:    {resent.figures()}")
    assert only_new.lost == resent.lost == 0
    assert abs(resent.deduplicated - only_new.deduplicated) <= 0.02 * only_new.deduplicated
    assert abs(resent.cached_tokens - only_new.cached_tokens) <= 0.02 * only_new.cached_tokens
    assert resent.outcomes["matched"] == len(resent.prompts) - len(conversations)


async def test_the_sdk_answer_object_appended_as_is_matches(make_proxy) -> None:
    proxy = make_proxy()
    client = sdk_client(proxy)
    blocks = synthetic(1, 1)["c0"][0][1]
    extension = {"cpmemory": {"conversation_id": "o", "blocks": blocks}}
    messages: list[Any] = [{"role": "user", "content": "first?"}]
    try:
        first = await client.chat.completions.create(model="tiny", messages=messages, extra_body=extension)
        messages += [first.choices[0].message, {"role": "user", "content": "second?"}]  # the SDK's own object
        second = await client.chat.completions.create(model="tiny", messages=messages, extra_body=extension)
    finally:
        await client.close()
    assert second.model_extra["cpmemory"]["history"] == "matched"


async def test_a_streamed_answer_resent_matches(make_proxy) -> None:
    proxy = make_proxy()
    client = sdk_client(proxy)
    blocks = synthetic(1, 1)["c0"][0][1]
    extension = {"cpmemory": {"conversation_id": "s", "blocks": blocks}}
    messages: list[Any] = [{"role": "user", "content": "first?"}]
    try:
        stream = await client.chat.completions.create(model="tiny", messages=messages, extra_body=extension,
                                                      stream=True)
        answer = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "second?"}]
        second = await client.chat.completions.create(model="tiny", messages=messages, extra_body=extension)
    finally:
        await client.close()
    assert answer and second.model_extra["cpmemory"]["history"] == "matched"
