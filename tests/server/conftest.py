"""Fixtures: the proxy app in front of in-process mock engines (cpmemory.testing.mock_engine), over httpx's ASGI seam."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from cpmemory.testing.mock_engine import MockEngine
from cpmemory.routing.transport import HttpxChatTransport
from cpmemory.server.app import ServerConfig, create_app

ENGINE_URLS = ["http://engine-0", "http://engine-1"]


class FleetTransport(httpx.AsyncBaseTransport):
    """Sends each request to the mock engine named by its host."""

    def __init__(self, engines: dict[str, MockEngine]) -> None:
        self.engines = engines

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return self.engines[request.url.host].handle(request)


class Proxy:
    """A proxy app with its engines and an ASGI client."""

    def __init__(self, engines: list[MockEngine], memory: Any = None, **config: Any) -> None:
        self.engines = engines
        fleet = FleetTransport({httpx.URL(url).host: engine for url, engine in zip(ENGINE_URLS, engines)})
        self.transport = HttpxChatTransport(httpx.AsyncClient(transport=fleet))
        self.config = ServerConfig(engines=ENGINE_URLS[: len(engines)], **config)
        self.app = create_app(self.config, memory=memory, transport=self.transport)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://proxy")

    @property
    def service(self) -> Any:
        return self.app.state.service

    def engine_of(self, response_json: dict) -> MockEngine:
        return self.engines[response_json["cpmemory"]["replica"]]

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.transport.aclose()


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    made = Proxy([MockEngine(block_size=16, capacity_blocks=4096) for _ in ENGINE_URLS])
    yield made
    await made.aclose()


@pytest.fixture
async def make_proxy():
    made: list[Proxy] = []

    def factory(engine_count: int = 2, memory: Any = None, **config: Any) -> Proxy:
        proxy = Proxy([MockEngine(block_size=16, capacity_blocks=4096) for _ in range(engine_count)], memory,
                      **config)
        made.append(proxy)
        return proxy

    yield factory
    for proxy in made:
        await proxy.aclose()  # closing twice is harmless
