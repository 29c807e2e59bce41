"""Budget cuts through the proxy: a client history with tool calls cut to the engine's context always reaches the
engine as a valid chat, and the response and /metrics say what was dropped."""
from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.server.conftest import Proxy
from tests.unit.session.test_budget_cuts import BLOCKS, histories, valid_chat


async def cut_through_proxy(history: list[dict[str, Any]], context: int) -> None:
    proxy = Proxy(engine_count=1)
    proxy.engines[0].max_model_len = context
    try:
        body = {"model": "tiny", "max_tokens": 8, "cpmemory": {"conversation_id": "c", "blocks": BLOCKS},
                "messages": [{"role": "system", "content": "Be brief."}, *history,
                             {"role": "user", "content": "What about the harbor?"}]}
        response = await proxy.client.post("/v1/chat/completions", json=body)
        if response.status_code == 400:  # the turn alone does not fit the context: refused, nothing sent
            assert not proxy.engines[0].requests
            return
        assert response.status_code == 200, response.text
        sent = proxy.engines[0].requests[-1]["body"]["messages"]
        assert valid_chat(sent)
        kept = sent[1:-1]
        assert kept == history[len(history) - len(kept):]
        dropped = history[: len(history) - len(kept)]
        info = response.json()["cpmemory"]
        assert info["history_dropped"] == {"messages": len(dropped), "turns": sum(m["role"] == "user" for m in dropped)}
        if dropped:
            metrics = (await proxy.client.get("/metrics")).text
            assert f'cpmemory_history_dropped_total{{unit="messages"}} {float(len(dropped))}' in metrics
    finally:
        await proxy.aclose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), st.integers(300, 2500))
def test_a_cut_through_the_proxy_keeps_tool_calls_with_their_results(history: list[dict[str, Any]],
                                                                     context: int) -> None:
    asyncio.run(cut_through_proxy(history, context))
