"""Real vLLM replicas (CPM_VLLM_URL, CPM_VLLM_URL_2; `.ci/vllm.sh ci-up` starts them): one conversation's turns stay on
one replica and reuse its prefix cache; when a replica stops mid-run, requests fail over with nothing lost."""
from __future__ import annotations

import asyncio
import contextlib
import os

import httpx
import pytest

from cpmemory.bench.load import RecordingTransport
from cpmemory.core.invariants import check_no_loss
from cpmemory.routing.router import RouterConfig, conversation_affinity_key
from cpmemory.routing.transport import HttpxChatTransport
from cpmemory.server.app import ServerConfig, create_app

pytestmark = pytest.mark.vllm
URLS = [os.environ.get("CPM_VLLM_URL"), os.environ.get("CPM_VLLM_URL_2")]
if not all(URLS):
    pytest.skip("CPM_VLLM_URL and CPM_VLLM_URL_2 are not set", allow_module_level=True)

DOCS = [{"id": f"v{i}", "text": f"Report {i}: the committee reviewed item {i} and approved the budget for the "
         f"river bridge, the harbor lights and the school roof in district {i}. " * 2} for i in range(10)]


class TcpRelay:
    """A loopback TCP relay in front of a replica; close() makes the replica unreachable (connections reset)."""

    def __init__(self, target: str) -> None:
        self.host, self.port = httpx.URL(target).host, httpx.URL(target).port
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        self.writers.update({writer, up_writer})

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self.writers):
            writer.transport.abort()


def _body(conversation: str, turn: int) -> tuple[dict, list[dict]]:
    start = sum(map(ord, conversation)) % 4 + turn  # deterministic (str hash is salted per process)
    blocks = DOCS[start:start + 2]
    return ({"model": "tiny", "max_tokens": 4, "temperature": 0,
             "messages": [{"role": "user", "content": f"What was approved? ({turn})"}],
             "cpmemory": {"conversation_id": conversation, "blocks": blocks}}, blocks)


async def _run_turn(client: httpx.AsyncClient, recording: RecordingTransport, conversation: str, turn: int) -> dict:
    body, blocks = _body(conversation, turn)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    info = response.json()["cpmemory"]
    assert check_no_loss(blocks, recording.sent[info["request_id"]]).ok
    return info


async def test_real_replicas_affinity_cache_reuse_and_failover() -> None:
    relay = TcpRelay(URLS[1])
    relayed = await relay.start()
    recording = RecordingTransport(HttpxChatTransport())
    # rendezvous homes (the affinity policy) make the failover deterministic; prefix routing on real replicas is
    # tested in test_vllm_router.py
    app = create_app(ServerConfig(engines=[URLS[0], relayed], engine_timeout_s=300,
                                  router=RouterConfig(policy="affinity")), transport=recording)
    router = app.state.service.dispatcher.router
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=120)
    # two conversations homed on each replica (rendezvous hashing decides; pick names accordingly)
    names = [f"real-{n}" for n in range(40)]
    homes = {name: router.choose(conversation_affinity_key("default", name)).index for name in names}
    chosen = [n for n in names if homes[n] == 0][:2] + [n for n in names if homes[n] == 1][:2]
    try:
        for turn in (1, 2):
            infos = [await _run_turn(client, recording, name, turn) for name in chosen]
            assert [info["replica"] for info in infos] == [homes[name] for name in chosen], infos
        main_second_turn = infos[0]
        assert main_second_turn["cached_tokens"] > 0  # replica 0 (17,408 tokens of cache) kept turn 1's prefix
        await relay.close()  # replica 2 stops answering
        infos = [await _run_turn(client, recording, name, 3) for name in chosen]
        assert {info["replica"] for info in infos} == {0}
        assert sum(info["failovers"] for info in infos) == 1 and not router.status()[1].healthy
        assert all("referenced" in {d["status"] for d in info["decisions"]} for info in infos)
        # a streamed turn is relayed and committed: the next turn gets the next number
        body, _ = _body(chosen[0], 4)
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and b"data: [DONE]" in streamed.content
        assert (await _run_turn(client, recording, chosen[0], 5))["turn"] == 5
    finally:
        await client.aclose()
        await recording.aclose()
        await relay.close()
