"""The proxy quick start as a user runs it: ``cpmemory mock-engine`` and ``cpmemory serve`` as real processes, the
official ``openai`` SDK as the client (docs/guides/proxy.md, examples/openai_proxy.py)."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import ROOT, Process, free_port

openai = pytest.importorskip("openai")

CLI = [sys.executable, "-m", "cpmemory.cli"]
DOCUMENTS = [{"id": f"doc-{i}", "text": f"Document {i}: " + f"fact {i} about the river. " * 30} for i in range(3)]


@pytest.fixture
def quickstart():
    engine_port, proxy_port = free_port(), free_port()
    engine = Process([*CLI, "mock-engine", "--port", str(engine_port)], engine_port, "/health")
    proxy = Process([*CLI, "serve", "--engine", f"http://127.0.0.1:{engine_port}", "--port", str(proxy_port)],
                    proxy_port, "/livez")
    try:
        engine.start()
        proxy.start()
        yield proxy
    finally:
        proxy.stop()
        engine.stop()


def test_the_openai_sdk_lists_models_and_runs_turns_through_the_proxy(quickstart) -> None:
    client = openai.OpenAI(base_url=quickstart.url + "/v1", api_key="not-needed", max_retries=0)
    model = client.models.list().data[0].id
    assert model == "mock-model"
    history = [{"role": "user", "content": "What is fact 1?"}]
    infos = []
    for question in ("What is fact 2?", "And fact 0?"):
        response = client.chat.completions.create(
            model=model, messages=history, max_tokens=32,
            extra_body={"cpmemory": {"conversation_id": "sdk", "blocks": DOCUMENTS}})
        infos.append(response.model_extra["cpmemory"])
        history += [{"role": "assistant", "content": response.choices[0].message.content},
                    {"role": "user", "content": question}]
    assert [info["turn"] for info in infos] == [1, 2] and all(info["committed"] for info in infos)
    assert {d["status"] for d in infos[1]["decisions"]} == {"referenced"} and infos[1]["cached_tokens"] > 0

    stream = client.chat.completions.create(
        model=model, messages=history, max_tokens=32, stream=True,
        extra_body={"cpmemory": {"conversation_id": "sdk", "blocks": DOCUMENTS}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "mock engine" in text
    metrics = httpx.get(quickstart.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    assert values['cpmemory_blocks_total{status="referenced"}'] == 6  # the streamed turn's three counted too
    assert httpx.get(quickstart.url + "/readyz").json()["ready"] is True

    with pytest.raises(openai.BadRequestError) as rejected:
        client.chat.completions.create(model=model, messages=history, max_tokens=40_000,
                                       extra_body={"cpmemory": {"conversation_id": "sdk", "blocks": DOCUMENTS}})
    assert rejected.value.param == "max_tokens"


def test_serve_refuses_to_start_on_a_store_it_cannot_use() -> None:
    started = subprocess.run([*CLI, "serve", "--engine", "http://127.0.0.1:9", "--port", str(free_port()),
                              "--redis", "redis://127.0.0.1:1/0"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert started.returncode == 2
    assert "the session store cannot be used" in started.stderr and "cannot be reached" in started.stderr


@pytest.mark.cluster
def test_serve_on_a_cluster_node_given_as_one_server_says_to_use_the_cluster_scheme(redis_cluster) -> None:
    started = subprocess.run([*CLI, "serve", "--engine", "http://127.0.0.1:9", "--port", str(free_port()),
                              "--redis", redis_cluster.url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert started.returncode == 2 and "redis+cluster://" in started.stderr
