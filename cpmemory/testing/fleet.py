"""A fleet of in-process mock engines addressed by URL: the one fake engine fleet of the benchmarks and the tests.

::

    fleet = MockFleet(["http://engine-0", "http://engine-1"], block_size=16, capacity_blocks=4096)
    transport = fleet.chat_transport()          # a ChatTransport (the router's seam) over the fleet
    create_app(ServerConfig(engines=fleet.urls), transport=transport)
    fleet.engine("http://engine-0").requests    # what each replica received

Requests reach the :class:`~cpmemory.testing.mock_engine.MockEngine` named by their URL's host, through httpx's
transport seam, so the code under test runs its real HTTP client (:mod:`cpmemory.engines.client`). Outages:
``fleet.set_down(url)`` (connection refused) and ``fleet.engine(url).fail_next(status=...)`` (an error status).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cpmemory.errors import MissingDependencyError
from cpmemory.routing.transport import HttpxChatTransport
from cpmemory.testing.mock_engine import MockEngine


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("engines", "httpx") from error
    return httpx


class MockFleet:
    """Mock engine replicas keyed by URL host. Mutable; thread-safe as far as each engine is."""

    def __init__(self, urls: Iterable[str] | int, **engine_options: Any) -> None:
        """One ``MockEngine(**engine_options)`` per URL (an int ``n`` names them ``http://engine-0`` ...)."""
        httpx = _httpx()
        self.urls = [f"http://engine-{i}" for i in range(urls)] if isinstance(urls, int) else list(urls)
        self.engines = {httpx.URL(url).host: MockEngine(**engine_options) for url in self.urls}
        self.calls: list[tuple[str, dict[str, Any]]] = []  # (base URL, chat body) of every chat request

    def engine(self, url_or_index: str | int) -> MockEngine:
        """The engine behind a base URL (or its index in ``urls``)."""
        url = self.urls[url_or_index] if isinstance(url_or_index, int) else url_or_index
        return self.engines[_httpx().URL(url).host]

    def set_down(self, url: str, down: bool = True) -> None:
        """Make a replica refuse connections (or answer again)."""
        self.engine(url).down = down

    def handle(self, request: Any) -> Any:
        """Answer one (read) httpx request with the engine its host names."""
        engine = self.engines[request.url.host]
        if request.url.path.endswith("/chat/completions") and not engine.down:
            import json

            self.calls.append((f"{request.url.scheme}://{request.url.host}", json.loads(request.content or b"{}")))
        return engine.handle(request)

    def async_transport(self) -> Any:
        """An ``httpx.AsyncBaseTransport`` over the fleet (for ``httpx.AsyncClient(transport=...)``)."""
        _httpx()
        import httpx

        fleet = self

        class _FleetTransport(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: Any) -> Any:
                await request.aread()
                return fleet.handle(request)

        return _FleetTransport()

    def sync_transport(self) -> Any:
        """An ``httpx.BaseTransport`` over the fleet (for ``httpx.Client`` and ``EngineClient``)."""
        return _httpx().MockTransport(self.handle)

    def chat_transport(self) -> HttpxChatTransport:
        """The router's ``ChatTransport`` over the fleet (the caller closes it)."""
        return HttpxChatTransport(_httpx().AsyncClient(transport=self.async_transport()))
