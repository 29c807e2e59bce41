"""The seam between routing and HTTP: send one chat completion to one replica.

``ChatTransport`` is the protocol the dispatcher, the proxy and Chain-of-Agents use; ``HttpxChatTransport`` implements
it with the engine client (:class:`cpmemory.engines.client.AsyncEngineClient`, one per replica) over one shared
``httpx.AsyncClient`` (connection pooling across replicas; the replica is chosen per call, which is what routing
needs). Tests pass an ``httpx.AsyncClient`` over an in-process fleet (:class:`cpmemory.testing.fleet.MockFleet`).

Errors (all ``EngineError``, from the engine client)::

    EngineError
    ├── EngineUnreachableError   connection refused / reset, timeout, 502-504: the replica is taken out of rotation
    └── EngineStatusError          the engine answered with another error status (carries status and body)
    InvalidInputError            the payload cannot be encoded (a lone surrogate): nothing was sent
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from cpmemory.engines.client import UNREACHABLE_STATUSES, AsyncEngineClient, EngineSettings
from cpmemory.engines.openai_wire import CHAT_PATH
from cpmemory.errors import MissingDependencyError

__all__ = ["UNREACHABLE_STATUSES", "ChatTransport", "EngineStream", "HttpxChatTransport"]


class EngineStream(Protocol):
    """An open streaming response (server-sent events)."""

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class ChatTransport(Protocol):
    """Sends OpenAI-compatible chat completions to a replica chosen by the caller."""

    async def complete(
        self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> dict[str, Any]: ...

    async def open_stream(
        self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> EngineStream: ...

    async def is_healthy(self, base_url: str) -> bool: ...

    async def aclose(self) -> None: ...


class HttpxChatTransport:
    """``ChatTransport`` over the engine client. Owns its ``httpx.AsyncClient`` unless one is given."""

    def __init__(self, client: Any = None, *, health_path: str = "/health", health_timeout_s: float = 2.0) -> None:
        """Create the transport; ``client`` is an ``httpx.AsyncClient`` (one is made if None). No IO."""
        try:
            import httpx
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("server", "httpx") from error
        self._client = client or httpx.AsyncClient(limits=httpx.Limits(max_connections=1024))
        self._replicas: dict[str, AsyncEngineClient] = {}
        self._health_path = health_path
        self._health_timeout_s = health_timeout_s

    def replica(self, base_url: str) -> AsyncEngineClient:
        """The engine client of one replica (made on first use; every replica shares the pool)."""
        client = self._replicas.get(base_url)
        if client is None:
            client = AsyncEngineClient(EngineSettings(base_url=base_url), http=self._client)
            self._replicas[base_url] = client
        return client

    @property
    def client(self) -> Any:
        """The ``httpx.AsyncClient`` (also used for ``/v1/models`` and ``/tokenize``, cpmemory.server.budget)."""
        return self._client

    async def complete(
        self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> dict[str, Any]:
        """POST ``/v1/chat/completions`` and return the decoded JSON object (errors: see the module)."""
        return await self.replica(base_url).post_json(CHAT_PATH, payload, headers, timeout_s=timeout_s)

    async def open_stream(
        self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> EngineStream:
        """POST a streaming chat completion; return the open stream once the status is known to be 2xx."""
        return await self.replica(base_url).open_stream(CHAT_PATH, payload, headers, timeout_s=timeout_s)

    async def is_healthy(self, base_url: str) -> bool:
        """GET the replica's health path; True on HTTP 200. Never raises."""
        return await self.replica(base_url).health(path=self._health_path, timeout_s=self._health_timeout_s)

    async def aclose(self) -> None:
        """Close the underlying client."""
        await self._client.aclose()
