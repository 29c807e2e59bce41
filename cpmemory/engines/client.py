"""HTTP clients for OpenAI-compatible engines (vLLM; SGLang-compatible request ids), sync and async.

The request building and response parsing are sans-IO functions shared by :class:`EngineClient` and
:class:`AsyncEngineClient`; the two classes only move bytes. Tests swap the network for an in-process engine
through httpx's transport seam (see :mod:`cpmemory.testing.mock_engine`).

Every chat request carries its request id twice: ``X-Request-Id`` (vLLM names the completion after it) and the
body field ``request_id`` (vLLM's and SGLang's extension field). ``cache_salt`` isolates a tenant's prefix cache
(vLLM); ``usage.prompt_tokens_details.cached_tokens`` is read back (servers need
``--enable-prompt-tokens-details``; streams ask for ``stream_options.include_usage``).

Errors::

    EngineError                      connection refused, reset, timeout, malformed response
    └── EngineStatusError            the engine answered with an HTTP error status (``status_code``, ``body``)

There are no retries: the router fails over to another replica instead.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Self

from cpmemory.errors import EngineError, EngineStatusError, MissingDependencyError

Message = Mapping[str, Any]


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


@dataclass(frozen=True, slots=True)
class ChatResult:
    """One finished chat completion.

    Attributes:
        request_id: the id sent with the request.
        content: the generated text.
        prompt_tokens / completion_tokens / cached_tokens: from the usage block (cached_tokens is None when
            the engine does not report it).
        ttft_s: time to the first generated token (streams only; None otherwise).
        total_s: time to the end of the response.
    """

    request_id: str
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    ttft_s: float | None
    total_s: float
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The engine's KV-cache configuration, from ``/metrics`` ``vllm:cache_config_info``."""

    block_size: int
    hash_algorithm: str
    prefix_caching: bool
    num_blocks: int | None


# -- sans-IO: requests ---------------------------------------------------------------------------------------
def chat_body(messages: Sequence[Message], *, model: str, request_id: str, stream: bool, max_tokens: int | None,
              cache_salt: str | None = None, extra: Mapping[str, Any] | None = None,
              id_fields: Sequence[str] = ("request_id",)) -> dict[str, Any]:
    """The JSON body of a chat completion. ``extra`` fields are added last (temperature, vllm_xargs, ...)."""
    body: dict[str, Any] = {"model": model, "messages": [dict(message) for message in messages], "stream": stream}
    for field_name in id_fields:
        body[field_name] = request_id
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    if cache_salt:
        body["cache_salt"] = cache_salt
    if extra:
        body.update(extra)
    return body


def request_headers(request_id: str | None, api_key: str | None) -> dict[str, str]:
    """Headers for one request: the request id (vLLM and SGLang read X-Request-Id) and the bearer token."""
    headers: dict[str, str] = {}
    if request_id:
        headers["X-Request-Id"] = request_id
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def tokenize_body(messages: Sequence[Message] | None, prompt: str | None, model: str) -> dict[str, Any]:
    """Body of ``/tokenize``: chat messages (template applied, generation prompt added, as for a chat request)."""
    if (messages is None) == (prompt is None):
        raise ValueError("give exactly one of messages or prompt")
    if messages is not None:
        return {"model": model, "messages": [dict(message) for message in messages],
                "add_generation_prompt": True}
    return {"model": model, "prompt": prompt}


# -- sans-IO: responses --------------------------------------------------------------------------------------
def _usage_numbers(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    if not isinstance(usage, Mapping):
        return None, None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), cached


def parse_chat_response(payload: Any, *, request_id: str, total_s: float) -> ChatResult:
    """Parse a non-streamed chat completion.

    Raises:
        EngineError: the payload is not a chat completion.
    """
    try:
        choice = payload["choices"][0]
        content = choice["message"].get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise EngineError(f"malformed chat completion: {str(payload)[:200]}") from error
    prompt, completion, cached = _usage_numbers(payload.get("usage"))
    return ChatResult(request_id=request_id, content=content, prompt_tokens=prompt, completion_tokens=completion,
                      cached_tokens=cached, finish_reason=choice.get("finish_reason"), ttft_s=None,
                      total_s=total_s, response_id=payload.get("id"))


class StreamAccumulator:
    """Folds server-sent-event lines of a streamed chat completion into a :class:`ChatResult`. Mutable."""

    def __init__(self, request_id: str, started: float) -> None:
        self.request_id = request_id
        self.started = started
        self.first_token_at: float | None = None
        self.parts: list[str] = []
        self.usage: Mapping[str, Any] | None = None
        self.finish_reason: str | None = None
        self.response_id: str | None = None
        self.done = False

    def feed_line(self, line: str, now: float) -> str | None:
        """Consume one SSE line; return the text delta it carried (None for none).

        Raises:
            EngineError: a data line that is not JSON, or an error object sent in the stream.
        """
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as error:
            raise EngineError(f"malformed stream chunk: {data[:200]}") from error
        if not isinstance(chunk, dict):
            raise EngineError(f"malformed stream chunk: {data[:200]}")
        if "error" in chunk:
            raise EngineError(f"engine error in stream: {str(chunk['error'])[:300]}")
        self.response_id = self.response_id or chunk.get("id")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        delta_text: str | None = None
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or choice.get("text")
            if piece:
                delta_text = (delta_text or "") + piece
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if delta_text is not None or (self.finish_reason and self.first_token_at is None):
            # a first token that decodes to nothing still ends the prefill: count the finish as first token
            self.first_token_at = self.first_token_at or now
        if delta_text:
            self.parts.append(delta_text)
        return delta_text

    def result(self, now: float) -> ChatResult:
        """The finished result (TTFT measured from ``started``)."""
        prompt, completion, cached = _usage_numbers(self.usage)
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        return ChatResult(request_id=self.request_id, content="".join(self.parts), prompt_tokens=prompt,
                          completion_tokens=completion, cached_tokens=cached, finish_reason=self.finish_reason,
                          ttft_s=ttft, total_s=now - self.started, response_id=self.response_id)


def parse_tokenize(payload: Any) -> list[int]:
    """Token ids from a ``/tokenize`` answer. Raises EngineError when malformed."""
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(token, int) for token in tokens):
        raise EngineError(f"malformed /tokenize answer: {str(payload)[:200]}")
    return tokens


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Parse Prometheus text exposition into ``(name, labels, value)`` samples (comments skipped)."""
    samples = []
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        try:
            samples.append((match.group(1), labels, float(match.group(3))))
        except ValueError:
            continue
    return samples


def metric_total(samples: Iterable[tuple[str, dict[str, str], float]], name: str) -> float | None:
    """Sum of every sample named ``name`` (over label sets); None when absent."""
    values = [value for sample_name, _labels, value in samples if sample_name == name]
    return sum(values) if values else None


def parse_cache_config(text: str) -> CacheConfig:
    """The KV-cache configuration from ``/metrics``. Raises EngineError when ``vllm:cache_config_info`` is absent."""
    for name, labels, _value in parse_metrics(text):
        if name == "vllm:cache_config_info" and labels.get("block_size", "").isdigit():
            blocks = labels.get("num_gpu_blocks", "")
            return CacheConfig(block_size=int(labels["block_size"]),
                               hash_algorithm=labels.get("prefix_caching_hash_algo", "sha256"),
                               prefix_caching=labels.get("enable_prefix_caching", "True") == "True",
                               num_blocks=int(blocks) if blocks.isdigit() else None)
    raise EngineError("the engine's /metrics has no vllm:cache_config_info with a block_size")


def reset_succeeded(response: Any) -> bool:
    """Whether a ``/reset_prefix_cache`` answer reports success (an empty or non-JSON 200 counts as success)."""
    try:
        payload = response.json()
    except ValueError:
        return True
    return not (isinstance(payload, dict) and payload.get("success") is False)


def _import_httpx():
    try:
        import httpx
    except ImportError as error:
        raise MissingDependencyError("engines", "httpx") from error
    return httpx


def _map_error(error: Exception, url: str) -> EngineError:
    httpx = _import_httpx()
    if isinstance(error, httpx.TimeoutException):
        return EngineError(f"engine {url} timed out ({type(error).__name__})")
    return EngineError(f"engine {url} unreachable: {type(error).__name__}: {error}")


def _timeout(settings: EngineSettings):
    return _import_httpx().Timeout(settings.timeout_s, connect=settings.connect_timeout_s)


def _check_status(response, url: str, body: str | None = None) -> None:
    if response.status_code >= 400:
        raise EngineStatusError(response.status_code, body if body is not None else response.text, url)


def _new_request_id() -> str:
    import uuid

    return f"cpm-{uuid.uuid4().hex}"


class EngineClient:
    """Synchronous client for one OpenAI-compatible engine replica. Not thread-safe for ``close``.

    Construction does no network IO. ``transport`` replaces the network (tests: ``MockEngine.transport()``).
    """

    def __init__(self, settings: EngineSettings | str, *, transport: Any = None) -> None:
        self.settings = EngineSettings(base_url=settings) if isinstance(settings, str) else settings
        httpx = _import_httpx()
        self._http = httpx.Client(base_url=self.settings.base_url, timeout=_timeout(self.settings),
                                  transport=transport)

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

    def _send(self, method: str, path: str, **kwargs: Any):
        try:
            response = self._http.request(method, path, **kwargs)
        except _import_httpx().HTTPError as error:
            raise _map_error(error, self.base_url) from error
        _check_status(response, self.base_url)
        return response

    def _json(self, response) -> Any:
        try:
            return response.json()
        except ValueError as error:
            raise EngineError(f"engine {self.base_url} sent non-JSON: {response.text[:200]}") from error

    def chat(self, messages: Sequence[Message], *, request_id: str | None = None, max_tokens: int | None = 256,
             cache_salt: str | None = None, stream: bool = False, extra: Mapping[str, Any] | None = None,
             ) -> ChatResult:
        """Run one chat completion (streamed when ``stream``; TTFT is measured only then).

        Raises:
            EngineStatusError: the engine answered with an error status.
            EngineError: unreachable, timed out, or a malformed answer.
        """
        request_id = request_id or _new_request_id()
        body = chat_body(messages, model=self.settings.model, request_id=request_id, stream=stream,
                         max_tokens=max_tokens, cache_salt=cache_salt, extra=extra,
                         id_fields=self.settings.request_id_fields)
        headers = request_headers(request_id, self.settings.api_key)
        if stream:
            return self._chat_stream(body, headers, request_id)
        started = time.perf_counter()
        response = self._send("POST", "/v1/chat/completions", json=body, headers=headers)
        return parse_chat_response(self._json(response), request_id=request_id,
                                   total_s=time.perf_counter() - started)

    def _chat_stream(self, body: dict[str, Any], headers: dict[str, str], request_id: str) -> ChatResult:
        started = time.perf_counter()
        accumulator = StreamAccumulator(request_id, started)
        httpx = _import_httpx()
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                if response.status_code >= 400:
                    response.read()
                    _check_status(response, self.base_url)
                for line in response.iter_lines():
                    accumulator.feed_line(line, time.perf_counter())
        except httpx.HTTPError as error:
            raise _map_error(error, self.base_url) from error
        return accumulator.result(time.perf_counter())

    def tokenize(self, messages: Sequence[Message] | None = None, *, prompt: str | None = None) -> list[int]:
        """Token ids exactly as the engine builds them for a chat request (template + generation prompt)."""
        response = self._send("POST", "/tokenize", json=tokenize_body(messages, prompt, self.settings.model))
        return parse_tokenize(self._json(response))

    def metrics_text(self) -> str:
        """The raw Prometheus text of ``/metrics``."""
        return self._send("GET", "/metrics").text

    def cache_config(self) -> CacheConfig:
        """Block size and hash algorithm of the engine's prefix cache (from ``/metrics``)."""
        return parse_cache_config(self.metrics_text())

    def health(self) -> bool:
        """True when ``/health`` answers 200 in time; never raises."""
        try:
            self._send("GET", "/health")
        except EngineError:
            return False
        return True

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
    """Asynchronous twin of :class:`EngineClient` (same methods, awaited)."""

    def __init__(self, settings: EngineSettings | str, *, transport: Any = None) -> None:
        self.settings = EngineSettings(base_url=settings) if isinstance(settings, str) else settings
        httpx = _import_httpx()
        self._http = httpx.AsyncClient(base_url=self.settings.base_url, timeout=_timeout(self.settings),
                                       transport=transport)

    @property
    def base_url(self) -> str:
        """The replica's base URL."""
        return self.settings.base_url

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any):
        try:
            response = await self._http.request(method, path, **kwargs)
        except _import_httpx().HTTPError as error:
            raise _map_error(error, self.base_url) from error
        _check_status(response, self.base_url)
        return response

    def _json(self, response) -> Any:
        try:
            return response.json()
        except ValueError as error:
            raise EngineError(f"engine {self.base_url} sent non-JSON: {response.text[:200]}") from error

    async def chat(self, messages: Sequence[Message], *, request_id: str | None = None,
                   max_tokens: int | None = 256, cache_salt: str | None = None, stream: bool = False,
                   extra: Mapping[str, Any] | None = None) -> ChatResult:
        """Run one chat completion; see :meth:`EngineClient.chat`."""
        request_id = request_id or _new_request_id()
        body = chat_body(messages, model=self.settings.model, request_id=request_id, stream=stream,
                         max_tokens=max_tokens, cache_salt=cache_salt, extra=extra,
                         id_fields=self.settings.request_id_fields)
        headers = request_headers(request_id, self.settings.api_key)
        if stream:
            return await self._chat_stream(body, headers, request_id)
        started = time.perf_counter()
        response = await self._send("POST", "/v1/chat/completions", json=body, headers=headers)
        return parse_chat_response(self._json(response), request_id=request_id,
                                   total_s=time.perf_counter() - started)

    async def _chat_stream(self, body: dict[str, Any], headers: dict[str, str], request_id: str) -> ChatResult:
        started = time.perf_counter()
        accumulator = StreamAccumulator(request_id, started)
        httpx = _import_httpx()
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body,
                                         headers=headers) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _check_status(response, self.base_url)
                async for line in response.aiter_lines():
                    accumulator.feed_line(line, time.perf_counter())
        except httpx.HTTPError as error:
            raise _map_error(error, self.base_url) from error
        return accumulator.result(time.perf_counter())

    async def tokenize(self, messages: Sequence[Message] | None = None, *, prompt: str | None = None) -> list[int]:
        """Token ids as the engine builds them; see :meth:`EngineClient.tokenize`."""
        response = await self._send("POST", "/tokenize", json=tokenize_body(messages, prompt, self.settings.model))
        return parse_tokenize(self._json(response))

    async def metrics_text(self) -> str:
        """The raw Prometheus text of ``/metrics``."""
        return (await self._send("GET", "/metrics")).text

    async def cache_config(self) -> CacheConfig:
        """Block size and hash algorithm of the engine's prefix cache."""
        return parse_cache_config(await self.metrics_text())

    async def health(self) -> bool:
        """True when ``/health`` answers 200 in time; never raises."""
        try:
            await self._send("GET", "/health")
        except EngineError:
            return False
        return True

    async def reset_prefix_cache(self, *, attempts: int = 10, wait_s: float = 0.2) -> bool:
        """``POST /reset_prefix_cache`` (vLLM dev mode); see :meth:`EngineClient.reset_prefix_cache`."""
        import asyncio

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
