"""Fixture: a fleet of three mock engine replicas (vLLM-like prefix caches) behind the router's transport seam."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from cpmemory.testing.fleet import MockFleet

URLS = ["http://r0", "http://r1", "http://r2"]


class FleetTransport:
    """The fleet's ``ChatTransport`` plus the fleet's controls (``down``: URLs refusing connections)."""

    def __init__(self) -> None:
        self.fleet = MockFleet(URLS, block_size=16, capacity_blocks=4096,
                               reply=lambda body: f"answer {len(self.fleet.calls)}")
        self.transport = self.fleet.chat_transport()
        self.complete = self.transport.complete
        self.open_stream = self.transport.open_stream

    @property
    def calls(self) -> list:
        return self.fleet.calls

    def set_down(self, urls, down: bool = True) -> None:
        for url in urls:
            self.fleet.set_down(url, down)

    def reject_next(self, status: int = 400) -> None:
        for url in URLS:
            self.fleet.engine(url).fail_next(1, status=status)

    async def is_healthy(self, base_url: str) -> bool:
        return await self.transport.is_healthy(base_url)

    async def aclose(self) -> None:
        await self.transport.aclose()


@pytest.fixture
def fleet() -> Iterator[FleetTransport]:
    yield FleetTransport()
