"""The HTTP client for OpenAI-compatible engines (vLLM; SGLang-compatible request ids), sync and async.

What goes over the wire is built and read by :mod:`cpmemory.engines.openai_wire` (sans-IO); the classes here only
move bytes. :class:`AsyncEngineClient` is the one asynchronous client: the router's transport
(:class:`cpmemory.routing.transport.HttpxChatTransport`) and the proxy's KV sync use it too, one instance per
replica over one shared connection pool. :class:`EngineClient` is its synchronous twin. Tests swap the network for
an in-process engine through httpx's transport seam (:mod:`cpmemory.testing.mock_engine`).

Errors::

    EngineError
    ├── EngineUnreachableError      connection refused / reset, timeout, a body that is not JSON: another
    │   │                           replica may serve the call
    │   └── EngineGatewayError      502, 503, 504 (also an EngineStatusError)
    └── EngineStatusError           the engine answered with another HTTP error status (``status_code``, ``body``)
    InvalidInputError               the request cannot be encoded (a lone surrogate): nothing was sent

There are no retries: the router fails over to another replica instead.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Self

from cpmemory.engines.openai_wire import (
    CHAT_PATH,
    ChatResult,
    Message,
    SseLineBuffer,
    StreamState,
    chat_body,
    encode_body,
    parse_chat_response,
    parse_tokenize,
    parse_usage,
    request_headers,
    sse_data,
    tokenize_body,
)
from cpmemory.engines.vllm_admin import (
    CacheConfig,
    metric_total,
    parse_cache_config,
    parse_metrics,
    reset_succeeded,
)
from cpmemory.errors import (
    EngineError,
    EngineGatewayError,
    EngineStatusError,
    EngineUnreachableError,
    MissingDependencyError,
)

__all__ = [
    "AsyncEngineClient", "CacheConfig", "ChatResult", "EngineClient", "EngineSettings", "EngineStatusError",
    "StreamAccumulator", "chat_body", "metric_total", "parse_cache_config", "parse_chat_response", "parse_metrics",
    "parse_tokenize", "request_headers", "tokenize_body",
]

UNREACHABLE_STATUSES = frozenset({502, 503, 504})
JSON_HEADERS = {"Content-Type": "application/json"}


class EngineSettings(BaseModel):
    """Where and how to reach one engine replica."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field(description="e.g. http://127.0.0.1:8000 (without /v1)")
    model: str = "tiny"
    timeout_s: float = Field(120.0, gt=0, description="read timeout of one request")
    connect_timeout_s: float = Field(5.0, gt=0)
    api_key: str | None = None
    request_id_fields: tuple[str, ...] = Field(
        ("request_id",), description='body fields carrying the request id: ("request_id",) for vLLM, ("rid",) for SGLang')


class StreamAccumulator:
    """Folds the SSE lines of a streamed chat completion into a :class:`ChatResult` (choice 0). Mutable."""

    def __init__(self, request_id: str, started: float) -> None:
        """Start a stream sent at ``started`` (a ``time.perf_counter`` value)."""
        self.request_id = request_id
        self.started = started
        self.first_token_at: float | None = None
        self.state = StreamState()

    @property
    def done(self) -> bool:
        """True once ``[DONE]`` was read."""
        return self.state.done

    @property
    def parts(self) -> list[str]:
        """Choice 0's text so far (one string; joined, it is the answer)."""
        return [self.state.text()]

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last usage object seen."""
        return self.state.usage

    @property
    def finish_reason(self) -> str | None:
        """Choice 0's finish reason (None while it runs)."""
        return self.state.finish_reason()

    @property
    def response_id(self) -> str | None:
        """The engine's completion id."""
        return self.state.response_id

    def feed_line(self, line: str | bytes, now: float) -> str | None:
        """Consume one SSE line; return the text it added to choice 0 (None for none).

        Raises:
            EngineError: a data line that is not a JSON object, or an error object sent in the stream.
        """
        data = sse_data(line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line)
        if data is None:
            return None
        chunk, added = self.state.apply_data(data)
        if chunk is None:
            if data != b"[DONE]":
                raise EngineError(f"malformed stream chunk: {data[:200]!r}")
            return None
        if "error" in chunk:
            raise EngineError(f"engine error in stream: {str(chunk['error'])[:300]}")
        piece = added.get(0)
        if self.first_token_at is None and (piece is not None or self.state.finish_reason() is not None):
            # a first token that decodes to nothing still ends the prefill: count the finish as first token
            self.first_token_at = now
        return piece

    def result(self, now: float) -> ChatResult:
        """The finished result (TTFT measured from ``started``)."""
        usage = parse_usage(self.state.usage)
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        return ChatResult(request_id=self.request_id, content=self.state.text(), prompt_tokens=usage.prompt_tokens,
                          completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
                          finish_reason=self.state.finish_reason(), ttft_s=ttft, total_s=now - self.started,
                          response_id=self.state.response_id)


# -- shared by both clients ----------------------------------------------------------------------------------
def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as error:
        raise MissingDependencyError("engines", "httpx") from error
    return httpx


def _map_error(error: Exception, url: str) -> EngineError:
    if isinstance(error, _import_httpx().TimeoutException):
        return EngineUnreachableError(f"engine {url} timed out ({type(error).__name__})")
    return EngineUnreachableError(f"engine {url} unreachable: {type(error).__name__}: {error}")


def _check_status(status_code: int, body: bytes | str, url: str) -> None:
    if status_code in UNREACHABLE_STATUSES:
        raise EngineGatewayError(status_code, body, url)
    if status_code >= 400:
        raise EngineStatusError(status_code, body, url)


def _json(response: Any, url: str) -> Any:
    try:
        return response.json()
    except ValueError as error:
        raise EngineUnreachableError(f"engine {url} sent non-JSON: {response.text[:200]}") from error


def _json_object(response: Any, url: str) -> dict[str, Any]:
    payload = _json(response, url)
    if not isinstance(payload, dict):
        raise EngineUnreachableError(f"engine {url} sent a non-object JSON body")
    return payload


def _new_request_id() -> str:
    return f"cpm-{uuid.uuid4().hex}"


def _chat_request(settings: EngineSettings, messages: Sequence[Message], request_id: str | None, *,
                  max_tokens: int | None, cache_salt: str | None, stream: bool, extra: Mapping[str, Any] | None
                  ) -> tuple[str, dict[str, Any], dict[str, str]]:
    request_id = request_id or _new_request_id()
    body = chat_body(messages, model=settings.model, request_id=request_id, stream=stream, max_tokens=max_tokens,
                     cache_salt=cache_salt, extra=extra, id_fields=settings.request_id_fields)
    return request_id, body, request_headers(request_id, settings.api_key)


class EngineStream:
    """An open streaming response: its bytes (transport errors become ``EngineUnreachableError``), and close."""

    __slots__ = ("_response", "_url")

    def __init__(self, response: Any, url: str) -> None:
        """Wrap an open httpx response."""
        self._response = response
        self._url = url

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Yield the body as it arrives."""
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except _import_httpx().HTTPError as error:
            raise EngineUnreachableError(f"engine stream from {self._url} broke: {type(error).__name__}") from error

    async def aclose(self) -> None:
        """Close the response (idempotent)."""
        await self._response.aclose()


class EngineClient:
    """Synchronous client for one OpenAI-compatible engine replica. Not thread-safe for ``close``.

    Construction does no network IO. ``transport`` replaces the network (tests: ``MockEngine.transport()``).
    """

    def __init__(self, settings: EngineSettings | str, *, transport: Any = None) -> None:
        """Open a connection pool for ``settings.base_url`` (no IO yet)."""
        self.settings = EngineSettings(base_url=settings) if isinstance(settings, str) else settings
        httpx = _import_httpx()
        timeout = httpx.Timeout(self.settings.timeout_s, connect=self.settings.connect_timeout_s)
        self._http = httpx.Client(base_url=self.settings.base_url, timeout=timeout, transport=transport)

    @property
    def base_url(self) -> str:
        """The replica's base URL."""
        return self.settings.base_url

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None = None,
              headers: Mapping[str, str] | None = None) -> Any:
        content = None if body is None else encode_body(body)
        try:
            response = self._http.request(method, path, content=content,
                                          headers={**(JSON_HEADERS if body is not None else {}), **(headers or {})})
        except _import_httpx().HTTPError as error:
            raise _map_error(error, self.base_url) from error
        _check_status(response.status_code, response.text, self.base_url)
        return response

    def chat(self, messages: Sequence[Message], *, request_id: str | None = None, max_tokens: int | None = 256,
             cache_salt: str | None = None, stream: bool = False, extra: Mapping[str, Any] | None = None,
             ) -> ChatResult:
        """Run one chat completion (streamed when ``stream``; TTFT is measured only then).

        Raises:
            EngineStatusError: the engine answered with an error status.
            EngineError: unreachable, timed out, or a malformed answer.
            InvalidInputError: the messages cannot be encoded (nothing was sent).
        """
        request_id, body, headers = _chat_request(self.settings, messages, request_id, max_tokens=max_tokens,
                                                  cache_salt=cache_salt, stream=stream, extra=extra)
        started = time.perf_counter()
        if stream:
            return self._chat_stream(body, headers, request_id, started)
        response = self._send("POST", CHAT_PATH, body, headers)
        return parse_chat_response(_json(response, self.base_url), request_id=request_id,
                                   total_s=time.perf_counter() - started)

    def _chat_stream(self, body: dict[str, Any], headers: dict[str, str], request_id: str,
                     started: float) -> ChatResult:
        accumulator = StreamAccumulator(request_id, started)
        content = encode_body(body)
        try:
            with self._http.stream("POST", CHAT_PATH, content=content, headers={**JSON_HEADERS, **headers}) as response:
                if response.status_code >= 400:
                    response.read()
                    _check_status(response.status_code, response.text, self.base_url)
                for line in response.iter_lines():
                    accumulator.feed_line(line, time.perf_counter())
        except _import_httpx().HTTPError as error:
            raise _map_error(error, self.base_url) from error
        return accumulator.result(time.perf_counter())

    def tokenize(self, messages: Sequence[Message] | None = None, *, prompt: str | None = None,
                 model: str | None = None) -> list[int]:
        """Token ids exactly as the engine builds them for a chat request (template + generation prompt)."""
        response = self._send("POST", "/tokenize", tokenize_body(messages, prompt, model or self.settings.model))
        return parse_tokenize(_json(response, self.base_url))

    def metrics_text(self) -> str:
        """The raw Prometheus text of ``/metrics``."""
        return str(self._send("GET", "/metrics").text)

    def cache_config(self) -> CacheConfig:
        """Block size and hash algorithm of the engine's prefix cache (from ``/metrics``)."""
        return parse_cache_config(self.metrics_text())

    def health(self) -> bool:
        """True when ``/health`` answers 200 in time; never raises."""
        try:
            return bool(self._send("GET", "/health").status_code == 200)
        except EngineError:
            return False

    def reset_prefix_cache(self, *, attempts: int = 10, wait_s: float = 0.2) -> bool:
        """``POST /reset_prefix_cache`` (vLLM dev mode, VLLM_SERVER_DEV_MODE=1). Returns False when refused.

        vLLM answers ``{"success": false}`` while blocks are still held (a request finishing): the call is then
        repeated up to ``attempts`` times, ``wait_s`` apart.
        """
        for attempt in range(attempts):
            try:
                response = self._send("POST", "/reset_prefix_cache")
            except EngineStatusError:
                return False
            if reset_succeeded(response):
                return True
            if attempt + 1 < attempts:
                time.sleep(wait_s)
        return False


class AsyncEngineClient:
    """Asynchronous client for one replica: the same methods as :class:`EngineClient`, awaited, plus the raw
    calls the router's transport needs (:meth:`post_json`, :meth:`open_stream`).

    ``http`` shares an ``httpx.AsyncClient`` (one pool for every replica; the caller closes it); otherwise the
    client owns one (``transport`` replaces the network). Construction does no IO.
    """

    def __init__(self, settings: EngineSettings | str, *, transport: Any = None, http: Any = None) -> None:
        """Use ``http`` or open a pool (no IO yet)."""
        self.settings = EngineSettings(base_url=settings) if isinstance(settings, str) else settings
        httpx = _import_httpx()
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient(transport=transport)
        self._base = self.settings.base_url.rstrip("/")

    @property
    def base_url(self) -> str:
        """The replica's base URL."""
        return self.settings.base_url

    async def aclose(self) -> None:
        """Close the connection pool (only when this client opened it)."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _timeout(self, timeout_s: float | None) -> Any:
        read = timeout_s if timeout_s is not None else self.settings.timeout_s
        return _import_httpx().Timeout(read, connect=min(read, self.settings.connect_timeout_s))

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None, headers: Mapping[str, str] | None,
                 timeout_s: float | None) -> Any:
        content = None if body is None else encode_body(body)
        merged = {**(JSON_HEADERS if body is not None else {}), **(headers or {})}
        return self._http.build_request(method, self._base + path, content=content, headers=merged,
                                        timeout=self._timeout(timeout_s))

    async def _send(self, method: str, path: str, body: Mapping[str, Any] | None = None,
                    headers: Mapping[str, str] | None = None, *, timeout_s: float | None = None) -> Any:
        request = self._request(method, path, body, headers, timeout_s)
        try:
            response = await self._http.send(request)
        except _import_httpx().HTTPError as error:
            raise _map_error(error, self.base_url) from error
        _check_status(response.status_code, response.content, self.base_url)
        return response

    async def post_json(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None, *,
                        timeout_s: float | None = None) -> dict[str, Any]:
        """POST a JSON body; return the JSON object answered.

        Raises:
            EngineUnreachableError: connection error, timeout, 502-504, or a body that is not a JSON object.
            EngineStatusError: any other error status.
            InvalidInputError: ``body`` cannot be encoded (nothing was sent).
        """
        return _json_object(await self._send("POST", path, body, headers, timeout_s=timeout_s), self.base_url)

    async def open_stream(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None, *,
                          timeout_s: float | None = None) -> EngineStream:
        """POST a streaming request; return the open stream once its status is known to be 2xx (same errors as
        :meth:`post_json`; the caller closes the stream)."""
        request = self._request("POST", path, body, headers, timeout_s)
        httpx = _import_httpx()
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as error:
            raise _map_error(error, self.base_url) from error
        if response.status_code >= 400:
            try:
                content = await response.aread()
            except httpx.HTTPError:
                content = b""
            finally:
                await response.aclose()
            _check_status(response.status_code, content, self.base_url)
        return EngineStream(response, self.base_url)

    async def chat(self, messages: Sequence[Message], *, request_id: str | None = None,
                   max_tokens: int | None = 256, cache_salt: str | None = None, stream: bool = False,
                   extra: Mapping[str, Any] | None = None) -> ChatResult:
        """Run one chat completion; see :meth:`EngineClient.chat`."""
        request_id, body, headers = _chat_request(self.settings, messages, request_id, max_tokens=max_tokens,
                                                  cache_salt=cache_salt, stream=stream, extra=extra)
        started = time.perf_counter()
        if not stream:
            payload = await self.post_json(CHAT_PATH, body, headers)
            return parse_chat_response(payload, request_id=request_id, total_s=time.perf_counter() - started)
        accumulator = StreamAccumulator(request_id, started)
        opened = await self.open_stream(CHAT_PATH, body, headers)
        lines = SseLineBuffer()
        try:
            async for chunk in opened.aiter_bytes():
                for line in lines.feed(chunk):
                    accumulator.feed_line(line, time.perf_counter())
            for line in lines.feed(b"\n"):
                accumulator.feed_line(line, time.perf_counter())
        finally:
            await opened.aclose()
        return accumulator.result(time.perf_counter())

    async def tokenize(self, messages: Sequence[Message] | None = None, *, prompt: str | None = None,
                       model: str | None = None) -> list[int]:
        """Token ids as the engine builds them; see :meth:`EngineClient.tokenize`."""
        body = tokenize_body(messages, prompt, model or self.settings.model)
        response = await self._send("POST", "/tokenize", body)
        return parse_tokenize(_json(response, self.base_url))

    async def models(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The engine's ``GET /v1/models`` answer (vLLM and SGLang report each model's ``max_model_len``)."""
        return _json_object(await self._send("GET", "/v1/models", timeout_s=timeout_s), self.base_url)

    async def metrics_text(self) -> str:
        """The raw Prometheus text of ``/metrics``."""
        return str((await self._send("GET", "/metrics")).text)

    async def cache_config(self) -> CacheConfig:
        """Block size and hash algorithm of the engine's prefix cache."""
        return parse_cache_config(await self.metrics_text())

    async def health(self, *, path: str = "/health", timeout_s: float | None = None) -> bool:
        """True when ``path`` answers 200 in time; never raises."""
        try:
            return bool((await self._send("GET", path, timeout_s=timeout_s)).status_code == 200)
        except EngineError:
            return False

    async def reset_prefix_cache(self, *, attempts: int = 10, wait_s: float = 0.2) -> bool:
        """``POST /reset_prefix_cache`` (vLLM dev mode); see :meth:`EngineClient.reset_prefix_cache`."""
        for attempt in range(attempts):
            try:
                response = await self._send("POST", "/reset_prefix_cache")
            except EngineStatusError:
                return False
            if reset_succeeded(response):
                return True
            if attempt + 1 < attempts:
                await asyncio.sleep(wait_s)
        return False
