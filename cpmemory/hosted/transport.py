"""The proxy's upstream to a hosted provider: a ``ChatTransport`` (cpmemory.routing.transport) that speaks the
provider's API upstream while the proxy keeps speaking the OpenAI-compatible API to its clients.

Every answer comes back OpenAI-shaped, with the provider's cache counts in ``usage`` and a ``cpmemory.hosted``
object (tokens read, written and uncached, the estimated input cost) that the proxy merges into the turn's
``cpmemory`` field (:func:`upstream_info`); the totals go to ``/metrics`` (:class:`HostedCounters`).
A streamed request to OpenAI is relayed as OpenAI streams it (its usage chunk is read on the way); Anthropic's event
stream is translated to OpenAI chunks as it arrives (the usage, with ``cpmemory.hosted``, in the last chunk).

Errors: ``EngineUnreachableError`` (connection, timeout, 502-504) and ``EngineStatusError`` (any other error
status: a refused key, a bad request, a rate limit), as from a self-hosted engine.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from cpmemory.errors import (
    EngineGatewayError,
    EngineStatusError,
    EngineUnreachableError,
    MissingDependencyError,
)
from cpmemory.hosted.prices import HostedUsage, UsageTotals, parse_hosted_usage
from cpmemory.hosted.provider import HostedProvider, HostedRequest, HostedSettings

__all__ = ["HostedCounters", "HostedTransport", "build_hosted_transport", "upstream_info"]

GATEWAY_STATUSES = (502, 503, 504)


def upstream_info(response: Mapping[str, Any]) -> dict[str, Any]:
    """The ``cpmemory`` fields an upstream added to its answer (``hosted``), to merge into the turn's. Pure."""
    found = response.get("cpmemory")
    return dict(found) if isinstance(found, Mapping) else {}


class HostedCounters:
    """``/metrics`` totals of hosted calls (prometheus counters in the proxy's registry) and running totals."""

    def __init__(self, registry: Any = None) -> None:
        self.totals = UsageTotals()
        self._tokens: Any = None
        self._cost: Any = None
        if registry is not None:
            self.bind(registry)

    def bind(self, registry: Any) -> None:
        """Register the counters in ``registry`` (once; a second call is ignored)."""
        if self._tokens is not None:
            return
        from prometheus_client import Counter

        self._tokens = Counter("cpmemory_hosted_input_tokens", "Hosted provider input tokens by cache outcome",
                               ["provider", "kind"], registry=registry)
        self._cost = Counter("cpmemory_hosted_estimated_input_cost", "Estimated input cost of hosted calls "
                             "(the price table's currency)", ["provider"], registry=registry)

    def add(self, provider: HostedProvider, usage: HostedUsage, model: str) -> None:
        """Count one call (mutates the totals and the counters)."""
        price = provider.price(model)
        self.totals.add(usage, price)
        if self._tokens is None:
            return
        name = provider.name
        self._tokens.labels(provider=name, kind="cache_read").inc(usage.cache_read_tokens)
        self._tokens.labels(provider=name, kind="cache_write").inc(usage.cache_write_tokens
                                                                   + usage.cache_write_long_tokens)
        self._tokens.labels(provider=name, kind="uncached").inc(usage.uncached_tokens)
        if price is not None:
            self._cost.labels(provider=name).inc(usage.input_cost(price))


def _check(status: int, body: bytes, url: str) -> None:
    if status in GATEWAY_STATUSES:
        raise EngineGatewayError(status, body, url)
    if status >= 400:
        raise EngineStatusError(status, body, url)


class _OpenAIStream:
    """The provider's own SSE bytes, relayed; the usage chunk is counted when it passes."""

    def __init__(self, response: Any, on_usage: Any) -> None:
        self._response = response
        self._on_usage = on_usage
        self._pending = b""

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_bytes():
            self._scan(chunk)
            yield chunk

    def _scan(self, chunk: bytes) -> None:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    usage = json.loads(line[6:]).get("usage")
                except ValueError:
                    continue
                if isinstance(usage, Mapping):
                    self._on_usage(usage)

    async def aclose(self) -> None:
        await self._response.aclose()


def _chunk(base: Mapping[str, Any], **fields: Any) -> bytes:
    return f"data: {json.dumps({**base, **fields})}\n\n".encode()


class _AnthropicStream:
    """Anthropic's Messages event stream relayed as OpenAI chunks: the role at ``message_start``, each text delta,
    the finish reason at ``message_delta``, and at ``message_stop`` the usage (with ``cpmemory.hosted``) and
    ``[DONE]``; the call is counted there."""

    def __init__(self, response: Any, transport: HostedTransport, request: HostedRequest) -> None:
        self._response = response
        self._transport = transport
        self._request = request
        self._pending = b""
        self._message: dict[str, Any] = {}
        self._usage: dict[str, Any] = {}
        self._stop: Any = None
        self._base: dict[str, Any] = {"object": "chat.completion.chunk", "created": int(time.time())}

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_bytes():
            lines = (self._pending + chunk).split(b"\n")
            self._pending = lines.pop()
            for line in lines:
                if line.startswith(b"data:"):
                    try:
                        event = json.loads(line[5:].strip())
                    except ValueError:
                        continue
                    out = self._translate(event) if isinstance(event, Mapping) else b""
                    if out:
                        yield out

    def _translate(self, event: Mapping[str, Any]) -> bytes:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), Mapping):
            self._message = dict(event["message"])
            self._usage = dict(self._message.get("usage") or {})
            self._base.update(id=self._message.get("id"), model=self._message.get("model"))
            return _chunk(self._base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None}])
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta" and delta.get("text"):
                return _chunk(self._base, choices=[{"index": 0, "delta": {"content": delta["text"]},
                                                    "finish_reason": None}])
            return b""
        if kind == "message_delta":
            self._usage.update(event.get("usage") or {})
            self._stop = (event.get("delta") or {}).get("stop_reason")
            return b""
        if kind == "message_stop":
            return self._finish()
        if kind == "error":
            raise EngineUnreachableError(f"anthropic stream error: {event.get('error')}")
        return b""

    def _finish(self) -> bytes:
        message = {**self._message, "content": [], "stop_reason": self._stop, "usage": self._usage}
        answer = self._transport._answer({}, self._request, message)
        finish = answer["choices"][0]["finish_reason"]
        return (_chunk(self._base, choices=[{"index": 0, "delta": {}, "finish_reason": finish}])
                + _chunk(self._base, choices=[], usage=answer["usage"], cpmemory=answer["cpmemory"])
                + b"data: [DONE]\n\n")

    async def aclose(self) -> None:
        await self._response.aclose()


class HostedTransport:
    """``ChatTransport`` to one hosted provider; ``base_url`` from the router is ignored (the provider's root is
    in the settings). Owns its ``httpx.AsyncClient`` unless one is given (tests pass one over a mock provider)."""

    def __init__(self, settings: HostedSettings, *, client: Any = None, registry: Any = None) -> None:
        """No IO. ``registry``: the proxy's prometheus registry for the hosted counters (None: totals only)."""
        try:
            import httpx
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("engines", "httpx") from error
        self._httpx = httpx
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient()
        self.provider = HostedProvider(settings)
        self.counters = HostedCounters(registry)

    def _request(self, payload: Mapping[str, Any]) -> HostedRequest:
        return self.provider.request(payload)

    async def _post(self, request: HostedRequest, timeout_s: float, stream: bool) -> Any:
        try:
            built = self._client.build_request("POST", request.url, json=request.body, headers=request.headers,
                                               timeout=timeout_s)
            response = await self._client.send(built, stream=stream)
        except self._httpx.HTTPError as error:
            raise EngineUnreachableError(f"{self.provider.name} unreachable: {type(error).__name__}: {error}") \
                from error
        if response.status_code >= 400:
            body = await response.aread()
            await response.aclose()
            _check(response.status_code, body, request.url)
        return response

    def _answer(self, payload: Mapping[str, Any], request: HostedRequest, data: Any) -> dict[str, Any]:
        if not isinstance(data, Mapping):
            raise EngineUnreachableError(f"{self.provider.name} sent a non-object JSON body")
        answer, usage = self.provider.response(data, created=int(time.time()))
        model = str(answer.get("model") or request.body.get("model") or payload.get("model") or "")
        self.counters.add(self.provider, usage, model)
        answer["cpmemory"] = {"hosted": self.provider.turn_info(usage, model, request.breakpoints)}
        return answer

    async def complete(
        self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> dict[str, Any]:
        """Send one chat completion to the provider; the OpenAI-style answer with ``cpmemory.hosted``."""
        request = self._request({**payload, "stream": False} if payload.get("stream") else payload)
        response = await self._post(request, timeout_s, stream=False)
        try:
            data = response.json()
        except ValueError as error:
            raise EngineUnreachableError(f"{self.provider.name} sent non-JSON") from error
        return self._answer(payload, request, data)

    async def open_stream(
        self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> Any:
        """Open a streamed answer (see the module docstring)."""
        request = self._request(payload)
        response = await self._post(request, timeout_s, stream=True)
        if self.provider.name != "openai":
            return _AnthropicStream(response, self, request)
        model = str(request.body.get("model") or "")
        return _OpenAIStream(response, lambda usage: self.counters.add(self.provider, parse_hosted_usage(usage),
                                                                       model))

    async def is_healthy(self, base_url: str) -> bool:
        """A hosted provider is taken as up; a failed call says otherwise (the router takes it out of rotation)."""
        return True

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def build_hosted_transport(settings: HostedSettings | None, registry: Any = None, given: Any = None) -> Any:
    """The proxy's transport: ``given`` when there is one (a hosted one has its counters bound to ``registry``),
    else a :class:`HostedTransport` for ``settings``, else None (the proxy serves self-hosted engines)."""
    if given is not None:
        if isinstance(given, HostedTransport) and registry is not None:
            given.counters.bind(registry)
        return given
    return None if settings is None else HostedTransport(settings, registry=registry)
