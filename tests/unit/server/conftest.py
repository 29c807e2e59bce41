"""Fixtures: the proxy app in front of in-process mock engines (cpmemory.testing.mock_engine), over httpx's ASGI seam."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from cpmemory.server.app import ServerConfig, create_app
from cpmemory.testing.fleet import MockFleet
from cpmemory.testing.mock_engine import MockEngine

ENGINE_URLS = ["http://engine-0", "http://engine-1"]


class Proxy:
    """A proxy app over a mock fleet, with an ASGI client."""

    def __init__(self, engine_count: int = 2, memory: Any = None, **config: Any) -> None:
        self.fleet = MockFleet(engine_count, block_size=16, capacity_blocks=4096)
        self.engines: list[MockEngine] = [self.fleet.engine(url) for url in self.fleet.urls]
        self.transport = self.fleet.chat_transport()
        self.config = ServerConfig(engines=self.fleet.urls, **config)
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
    made = Proxy(len(ENGINE_URLS))
    yield made
    await made.aclose()


@pytest.fixture
async def make_proxy():
    made: list[Proxy] = []

    def factory(engine_count: int = 2, memory: Any = None, **config: Any) -> Proxy:
        proxy = Proxy(engine_count, memory, **config)
        made.append(proxy)
        return proxy

    yield factory
    for proxy in made:
        await proxy.aclose()  # closing twice is harmless
