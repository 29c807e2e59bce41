"""Cache-fit admission end to end: the real proxy app (real facade, in-memory store) in front of mock engines whose
KV cache size is given (``replica_cache_tokens``). Two conversations whose histories do not fit one replica together
go to different replicas; a third waits until one of them has been idle for ``fit_idle_ms``; with admission off it
does not wait (the replicas' grace for idling is set long: here every call ends before the next starts). Streams and
plain calls both give their share back."""
from __future__ import annotations

import time
from typing import Any

import pytest

from cpmemory.core.invariants import check_no_loss

CACHE_TOKENS = 2_000  # per replica; fill 0.9: 1,800 tokens of live histories
IDLE_MS = 400.0


def body(conversation: str, stream: bool = False) -> dict[str, Any]:
    text = f"Passage of {conversation}: " + f"fact about {conversation}, told at length. " * 110  # ~1,200 tokens
    return {"model": "tiny", "max_tokens": 8, "stream": stream,
            "messages": [{"role": "user", "content": f"What about {conversation}?"}],
            "cpmemory": {"conversation_id": conversation, "blocks": [{"id": f"doc-{conversation}", "text": text}]}}


async def post(proxy: Any, conversation: str, stream: bool) -> tuple[float, int, str]:
    started = time.perf_counter()
    response = await proxy.client.post("/v1/chat/completions", json=body(conversation, stream))
    assert response.status_code == 200
    replica = int(response.headers["X-Cpmemory-Replica"]) if stream else response.json()["cpmemory"]["replica"]
    return time.perf_counter() - started, replica, response.text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_conversation_that_fits_nowhere_waits_until_one_goes_idle(make_proxy, stream: bool) -> None:
    proxy = make_proxy(2, replica_cache_tokens=CACHE_TOKENS, fit_idle_ms=IDLE_MS, fit_grace_ms=10 * IDLE_MS)
    _, first, _ = await post(proxy, "a", stream)
    _, second, _ = await post(proxy, "b", stream)
    assert first != second  # a and b do not fit one replica together
    waited, third, _ = await post(proxy, "c", stream)
    assert waited >= 0.5 * IDLE_MS / 1000  # c entered once a or b had been idle for fit_idle_ms
    assert third in (first, second)
    metrics = (await proxy.client.get("/metrics")).text
    assert 'cpmemory_fit_admissions_total{reason="room"} 3.0' in metrics
    assert "cpmemory_fit_wait_seconds_count 1.0" in metrics


async def test_a_live_conversations_next_turn_does_not_wait(make_proxy) -> None:
    proxy = make_proxy(1, replica_cache_tokens=CACHE_TOKENS, fit_idle_ms=IDLE_MS, fit_grace_ms=10 * IDLE_MS)
    await post(proxy, "a", False)
    waited, _, text = await post(proxy, "a", False)
    assert waited < 0.5 * IDLE_MS / 1000
    assert '"reason":"live"' not in text  # the reason is a metric, not part of the response
    metrics = (await proxy.client.get("/metrics")).text
    assert 'cpmemory_fit_admissions_total{reason="live"} 1.0' in metrics


async def test_with_admission_off_nothing_waits(make_proxy) -> None:
    proxy = make_proxy(2, replica_cache_tokens=CACHE_TOKENS, fit=False)
    for conversation in ("a", "b"):
        await post(proxy, conversation, False)
    waited, _, _ = await post(proxy, "c", False)
    assert waited < 0.5 * IDLE_MS / 1000


async def test_every_block_reaches_the_engine_while_turns_wait(make_proxy) -> None:
    proxy = make_proxy(1, replica_cache_tokens=CACHE_TOKENS, fit_idle_ms=50.0)
    sent = {conversation: body(conversation) for conversation in ("a", "b", "c")}
    for conversation in sent:
        await post(proxy, conversation, False)
    requests = proxy.engines[0].requests
    assert len(requests) == 3
    for request, conversation in zip(requests, sent):
        blocks = [(block["id"], block["text"]) for block in sent[conversation]["cpmemory"]["blocks"]]
        report = check_no_loss(blocks, request["body"]["messages"])
        assert report.ok, report
