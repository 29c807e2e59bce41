"""`cpmemory serve --kv-events` routes by the replicas' KV events: two engine processes publishing over ZMQ."""
from __future__ import annotations

import time

import httpx

BLOCKS = [{"id": f"doc-{i}", "text": f"Document {i}: " + f"fact {i} about the topic. " * 30} for i in range(3)]


def _metric(text: str, name: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            values[labels[len(name):]] = float(value)
    return values


def test_first_turns_follow_the_kv_events_to_the_replica_holding_their_prefix(processes) -> None:
    ports = [processes.free_port(), processes.free_port()]
    engines = [processes.engine(str(port)).start() for port in ports]
    args = []
    for port in ports:
        args += ["--kv-events", f"tcp://127.0.0.1:{port}"]
    proxy = processes.proxy([engine.url for engine in engines], *args).start()
    time.sleep(0.5)  # the subscribers connect
    replicas, cached = [], []
    for number in range(6):  # six RAG requests, each its own conversation, the same retrieved blocks
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"question {number}?"}],
                "cpmemory": {"conversation_id": f"rag-{number}", "blocks": BLOCKS}}
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        info = response.json()["cpmemory"]
        replicas.append(info["replica"])
        cached.append(info["cached_tokens"])
        time.sleep(0.2)  # the engine's BlockStored batch reaches the proxy
    assert len(set(replicas)) == 1 and all(tokens > 0 for tokens in cached[1:]), (replicas, cached)
    metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
    assert _metric(metrics, "cpmemory_route_prefix_view_synced") == {'{replica="0"}': 1.0, '{replica="1"}': 1.0}
    decisions = _metric(metrics, "cpmemory_route_decisions_total")
    assert sum(v for k, v in decisions.items() if 'reason="prefix"' in k) >= 5, decisions
