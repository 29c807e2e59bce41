"""The seam between routing and HTTP: send one chat completion to one replica.

``ChatTransport`` is the protocol the dispatcher, the proxy and Chain-of-Agents use; ``HttpxChatTransport`` implements
it with one shared ``httpx.AsyncClient`` (connection pooling across replicas; the base URL is chosen per call,
which is what routing needs). Tests pass an ``httpx.ASGITransport`` to run against an in-process engine.

Errors (all ``EngineError``)::

    EngineError
    ├── EngineUnreachableError   connection refused / reset, timeout, 502-504: the replica is taken out of rotation
    └── EngineStatusError          the engine answered with another error status (carries status and body)
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from cpmemory.errors import EngineStatusError, EngineUnreachableError, MissingDependencyError

UNREACHABLE_STATUSES = frozenset({502, 503, 504})


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


class _HttpxStream:
    __slots__ = ("_response",)

    def __init__(self, response: Any) -> None:
        self._response = response

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        import httpx

        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except (httpx.TransportError, httpx.TimeoutException) as error:
            raise EngineUnreachableError(f"engine stream broke: {type(error).__name__}") from error

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxChatTransport:
    """``ChatTransport`` over httpx. Owns its client unless one is given."""

    def __init__(self, client: Any = None, *, health_path: str = "/health", health_timeout_s: float = 2.0) -> None:
        """Create the transport; ``client`` is an ``httpx.AsyncClient`` (one is made if None). No IO."""
        try:
            import httpx
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("server", "httpx") from error
        self._httpx = httpx
        self._client = client or httpx.AsyncClient(limits=httpx.Limits(max_connections=1024))
        self._health_path = health_path
        self._health_timeout_s = health_timeout_s

    async def complete(
        self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> dict[str, Any]:
        """POST ``/v1/chat/completions`` and return the decoded JSON body.

        Raises:
            EngineUnreachableError: connection error, timeout, 502-504, or a body that is not a JSON object.
            EngineStatusError: any other error status.
        """
        httpx = self._httpx
        try:
            response = await self._client.post(
                f"{base_url}/v1/chat/completions", json=dict(payload), headers=dict(headers), timeout=timeout_s
            )
        except (httpx.TransportError, httpx.TimeoutException) as error:
            raise EngineUnreachableError(f"{base_url}: {type(error).__name__}") from error
        _raise_for_status(response.status_code, response.content)
        try:
            body = response.json()
        except ValueError as error:
            raise EngineUnreachableError(f"{base_url}: the engine answered with invalid JSON") from error
        if not isinstance(body, dict):
            raise EngineUnreachableError(f"{base_url}: the engine answered with a non-object JSON body")
        return body

    async def open_stream(
        self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> EngineStream:
        """POST a streaming chat completion; return the open stream once the status is known to be 2xx."""
        httpx = self._httpx
        request = self._client.build_request(
            "POST", f"{base_url}/v1/chat/completions", json=dict(payload), headers=dict(headers), timeout=timeout_s
        )
        try:
            response = await self._client.send(request, stream=True)
        except (httpx.TransportError, httpx.TimeoutException) as error:
            raise EngineUnreachableError(f"{base_url}: {type(error).__name__}") from error
        if response.status_code >= 400:
            try:
                content = await response.aread()
            except (httpx.TransportError, httpx.TimeoutException):
                content = b""
            finally:
                await response.aclose()
            _raise_for_status(response.status_code, content)
        return _HttpxStream(response)

    async def is_healthy(self, base_url: str) -> bool:
        """GET the replica's health path; True on HTTP 200. Never raises."""
        httpx = self._httpx
        try:
            response = await self._client.get(f"{base_url}{self._health_path}", timeout=self._health_timeout_s)
        except (httpx.TransportError, httpx.TimeoutException):
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        """Close the underlying client."""
        await self._client.aclose()


def _raise_for_status(status_code: int, content: bytes) -> None:
    if status_code in UNREACHABLE_STATUSES:
        raise EngineUnreachableError(f"engine answered HTTP {status_code}")
    if status_code >= 400:
        raise EngineStatusError(status_code, content)
