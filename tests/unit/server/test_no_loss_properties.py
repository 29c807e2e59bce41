"""Adversarial property suite over the proxy (ASGI, in-process mock engines): what the engine receives loses nothing.

Requests with repeated block ids, colliding labels and look-alike lines, system messages, tool calls, tool
messages, names and content parts in the client's history, a final user message or ``cpmemory.query``, several
turns per conversation; every engine request is judged by the independent checker against the client's request.
"""
from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmemory.core.invariants import check_no_loss
from tests.no_loss_cases import block_items, queries, tool_exchange
from tests.unit.server.conftest import Proxy

turns = st.lists(
    st.tuples(block_items, queries, st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=4
)


async def _run(steps: list[tuple[Any, ...]]) -> None:
    proxy = Proxy(2)
    try:
        for number, (items, query, system, tools, as_extension) in enumerate(steps):
            messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}] if system else []
            if tools:
                messages += tool_exchange(number)
            messages.append({"role": "user", "content": "Answer in French." if as_extension else query})
            blocks = [{"id": block_id, "text": text} for block_id, text in items]
            extension: dict[str, Any] = {"conversation_id": "c", "blocks": blocks}
            if as_extension:
                extension["query"] = query
            body = {"model": "tiny", "max_tokens": 4, "messages": messages, "cpmemory": extension}
            response = await proxy.client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            info = response.json()["cpmemory"]
            assert [d["original_rank"] for d in info["decisions"]] == list(range(len(blocks)))
            sent = proxy.engine_of(response.json()).requests[-1]["body"]["messages"]
            report = check_no_loss(blocks, sent, caller_messages=messages, query=query)
            assert report.ok, (report.violations, messages, blocks)
    finally:
        await proxy.aclose()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns)
def test_proxy_delivers_every_block_and_message(steps: list[tuple[Any, ...]]) -> None:
    asyncio.run(_run(steps))
