"""Behind a gateway (``--upstream``) the proxy learns from the replicas' KV events which replica served each turn.

Real processes: two mock engines publishing KV events over ZMQ, a sticky-session gateway in front of them (the
ground truth of where each request went is what each engine recorded), and ``cpmemory serve --upstream``.
"""
from __future__ import annotations

import time

import httpx


def _attributions(proxy_url: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in httpx.get(proxy_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("cpmemory_gateway_attributions_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('replica="')[1].split('"')[0]] = float(value)
    return counts


def _turn(proxy_url: str, conversation: str, number: int, *, stream: bool) -> None:
    blocks = [{"id": f"{conversation}-{number}-{i}", "text": f"{conversation} evidence {number}.{i} " + "y" * 200}
              for i in range(2)]
    body = {"model": "tiny", "stream": stream, "messages": [{"role": "user", "content": f"question {number}?"}],
            "cpmemory": {"conversation_id": conversation, "blocks": blocks}}
    response = httpx.post(proxy_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_the_kv_events_tell_which_replica_behind_the_gateway_served_each_turn(processes) -> None:
    kv_ports = [processes.free_port(), processes.free_port()]
    engines = [processes.engine(str(port)).start() for port in kv_ports]
    urls = [engine.url for engine in engines]
    gateway = processes.gateway(urls).start()
    proxy = processes.proxy(urls, "--upstream", gateway.url, "--upstream-kind", "vllm-router",
                            *(arg for port in kv_ports for arg in ("--kv-events", f"tcp://127.0.0.1:{port}"))).start()
    conversations, turns = [f"conv-{n}" for n in range(5)], 3
    for number in range(turns):
        for index, conversation in enumerate(conversations):
            _turn(proxy.url, conversation, number, stream=index % 2 == 1)  # streamed and whole answers alike
    served = [len(httpx.get(url + "/_mock/requests", timeout=10).json()) for url in urls]  # chat requests only
    assert sum(served) == len(conversations) * turns and min(served) > 0, served
    expected = {str(replica): float(count) for replica, count in enumerate(served)}
    deadline = time.monotonic() + 20
    while (counts := _attributions(proxy.url)) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counts == expected  # every turn attributed, each to the replica that recorded it
