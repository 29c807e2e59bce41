"""`cpmemory serve --kv-events`: an engine process publishes KV events over ZMQ; evictions reach the proxy's index."""
from __future__ import annotations

import time

import httpx


def _kv_gauges(proxy_url: str) -> dict[str, float]:
    text = httpx.get(proxy_url + "/metrics", timeout=10).text
    gauges = {}
    for line in text.splitlines():
        if line.startswith("cpmemory_kv_sync{"):
            labels, value = line.rsplit(" ", 1)
            gauges[labels.split('counter="')[1].split('"')[0]] = float(value)
    return gauges


def _wait_for(proxy_url: str, counter: str, at_least: float, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = _kv_gauges(proxy_url)
        if gauges.get(counter, 0) >= at_least or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def _turn(proxy_url: str, conversation: str, seed: int, *, stream: bool = False) -> None:
    blocks = [{"id": f"{conversation}-{i}", "text": f"block {seed}-{i} " + "x" * 180} for i in range(2)]
    body = {"model": "tiny", "stream": stream, "messages": [{"role": "user", "content": "q"}],
            "cpmemory": {"conversation_id": conversation, "blocks": blocks}}
    response = httpx.post(proxy_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_engine_evictions_arrive_as_kv_events_and_evict_index_leaves(processes) -> None:
    kv_port = processes.free_port()
    engine = processes.engine(str(kv_port), "48").start()  # 48 blocks of 16 tokens: a few prompts fill it
    proxy = processes.proxy([engine.url], "--kv-events", f"tcp://127.0.0.1:{kv_port}").start()
    _turn(proxy.url, "first", 0)
    gauges = _wait_for(proxy.url, "registered", 1)
    assert gauges.get("registered", 0) >= 1, gauges
    assert gauges.get("evicted_leaves", 0) == 0
    _turn(proxy.url, "streamed", 9, stream=True)  # a streamed turn is registered as well, once its answer ended
    assert _wait_for(proxy.url, "registered", 2).get("registered", 0) >= 2
    for number in range(1, 5):
        _turn(proxy.url, f"other-{number}", number)
    gauges = _wait_for(proxy.url, "evicted_leaves", 1)
    assert gauges.get("removed_blocks", 0) > 0 and gauges.get("evicted_leaves", 0) >= 1, gauges
