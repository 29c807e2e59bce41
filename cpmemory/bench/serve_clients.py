"""The two clients of ``cpmemory bench serve``: one per strategy, both streamed, both timed the same way.

* :class:`DirectClient` (strategy ``original``): builds the prompt itself (the replay's block format, relevance order,
  the session's full history: earlier user messages as sent and the engine's answers) and sends it straight to the
  engines with conversation affinity: a conversation's first turn to the least loaded replica, its later turns back
  to that one (the router's ``session`` policy, as vllm-router's session affinity does; the same failover loop the
  proxy uses, :class:`cpmemory.routing.dispatch.Dispatcher`), or to one ``--upstream`` router.
* :class:`ProxyClient` (strategy ``cpmemory``): sends only the question and the retrieved blocks to a ``cpmemory
  serve`` proxy (``cpmemory`` extension field); the proxy keeps the history, de-duplicates, orders and routes.

Both read the server-sent events line by line with :class:`cpmemory.engines.client.StreamAccumulator`: the TTFT is
the time from sending to the first generated token, the latency the time to the end of the stream, the token counts
come from the engine's final usage chunk. What reached the engine is kept per request for ``check_no_loss``.
"""
from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cpmemory.engines.client import StreamAccumulator
from cpmemory.errors import EngineError
from cpmemory.server.fit import FIT_HEADER, parse_fit_header

DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Sent:
    """One finished request as the client saw it (before the no-loss check).

    Attributes:
        ttft_s: time to the first token (None when the stream carried no token).
        latency_s: time to the end of the stream.
        prompt_tokens: the engine's usage (0 when absent).
        cached_tokens: ``prompt_tokens_details.cached_tokens`` of the usage (0 when absent).
        replica: index of the replica that answered (-1 when unknown, e.g. behind an upstream router).
        messages: the messages that reached the engine (None when they could not be observed).
        failovers: replicas failed over before this one answered (the direct client's; 0 through the proxy).
        fit: the proxy's cache-fit admission (``X-Cpmemory-Fit``: its reason and wait), None when it did not gate.
    """

    ttft_s: float | None
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: int
    messages: tuple[Mapping[str, str], ...] | None
    failovers: int = 0
    fit: tuple[str, float] | None = None


async def lines_of(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Split a byte stream into text lines (any chunking)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode("utf-8", "replace").strip()
    if buffer.strip():
        yield buffer.decode("utf-8", "replace").strip()


async def read_stream(chunks: AsyncIterator[bytes], started: float) -> StreamAccumulator:
    """Fold an SSE stream into an accumulator; raises EngineError on an error event or a stream without an end."""
    accumulator = StreamAccumulator("", started)
    async for line in lines_of(chunks):
        accumulator.feed_line(line, time.perf_counter())
    if not (accumulator.done or accumulator.finish_reason):
        raise EngineError("the stream ended before the answer did")
    return accumulator


def _usage(accumulator: StreamAccumulator) -> tuple[int, int]:
    usage = accumulator.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0)


def sampling(max_tokens: int) -> dict[str, Any]:
    """The sampling fields both strategies send (greedy, short answers: the prefill is what is measured)."""
    return {"max_tokens": max_tokens, "temperature": 0, "stream": True}


class DirectClient:
    """Strategy ``original``: full prompts straight to the engines (see the module docstring)."""

    def __init__(self, urls: Sequence[str], *, model: str, max_tokens: int, timeout_s: float, system_prompt: str,
                 failover: bool = True, transport: Any = None, name_sessions: bool = False,
                 policy: Literal["session", "affinity"] = "session", priority: bool = False) -> None:
        """Wire a conversation-affinity router over ``urls`` (engines, or one upstream router with
        ``failover=False``; ``name_sessions``: each turn names its conversation to it, as the proxy does with
        ``upstream_session``; ``policy``: the router's ``session`` placement or the ``affinity`` hash; ``priority``: each
        request carries vLLM's ``priority``, the tokens after the conversation's last answer); no IO."""
        import httpx

        from cpmemory.routing.dispatch import Dispatcher
        from cpmemory.routing.router import Router, RouterConfig
        from cpmemory.routing.transport import HttpxChatTransport

        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024), transport=transport)
        router = Router(list(urls), RouterConfig(policy=policy))
        self.failures: list[str] = []  # why a replica was failed over (EngineUnreachableError), in order
        self.dispatcher = Dispatcher(router, _FailureLog(HttpxChatTransport(client), self.failures),
                                     timeout_s=timeout_s, failover=failover, priority=priority)
        self.model, self.max_tokens, self.system_prompt = model, max_tokens, system_prompt
        self.name_sessions = name_sessions
        self.history: dict[str, list[dict[str, str]]] = defaultdict(list)

    def messages(self, conversation: str, blocks: Sequence[Any], query: str, multi_turn: bool) -> list[dict[str, str]]:
        """The prompt of one turn: system, the conversation's history (multi-turn), the user message."""
        from cpmemory.bench.prompts import plain_user_message

        user = plain_user_message(blocks, range(len(blocks)), query)
        history = self.history[conversation] if multi_turn else []
        return [{"role": "system", "content": self.system_prompt}, *history, {"role": "user", "content": user}]

    async def send(self, conversation: str, blocks: Sequence[Any], query: str, multi_turn: bool) -> Sent:
        """Send one turn; on success the user message and the engine's answer join the history."""
        from cpmemory.engines.openai_wire import session_params
        from cpmemory.routing.dispatch import RouteHint
        from cpmemory.routing.router import conversation_affinity_key

        messages = self.messages(conversation, blocks, query, multi_turn)
        request_id = "bench-" + uuid.uuid4().hex
        key = conversation_affinity_key(DEFAULT_TENANT, conversation)
        payload = {"model": self.model, "messages": messages, "request_id": request_id,
                   "stream_options": {"include_usage": True}, **sampling(self.max_tokens),
                   **({"session_params": session_params(key)} if self.name_sessions else {})}
        started = time.perf_counter()
        opened = await self.dispatcher.open_stream(key, payload, {"X-Request-Id": request_id},
                                                   RouteHint(sticky=multi_turn))
        try:
            accumulator = await read_stream(opened.stream.aiter_bytes(), started)
        finally:
            await opened.release()
        if multi_turn:
            answer = "".join(accumulator.parts)
            self.history[conversation].extend([messages[-1], {"role": "assistant", "content": answer}])
        prompt, cached = _usage(accumulator)
        return Sent(accumulator.first_token_at and accumulator.first_token_at - started,
                    time.perf_counter() - started, prompt, cached, opened.decision.index, tuple(messages),
                    opened.failovers)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.dispatcher.transport.aclose()


class _FailureLog:
    """A ChatTransport that notes every unreachable-engine error (the cause of a failover) before raising it."""

    def __init__(self, transport: Any, failures: list[str]) -> None:
        self.transport, self.failures = transport, failures

    async def complete(self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str],
                       timeout_s: float) -> dict[str, Any]:
        return await self._noted(self.transport.complete(base_url, payload, headers, timeout_s))

    async def open_stream(self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str],
                          timeout_s: float) -> Any:
        return await self._noted(self.transport.open_stream(base_url, payload, headers, timeout_s))

    async def _noted(self, call: Any) -> Any:
        from cpmemory.errors import EngineUnreachableError

        try:
            return await call
        except EngineUnreachableError as error:
            self.failures.append(f"{type(error).__name__}: {str(error)[:200]}")
            raise

    async def is_healthy(self, base_url: str) -> bool:
        return bool(await self.transport.is_healthy(base_url))

    async def aclose(self) -> None:
        await self.transport.aclose()


class ProxyClient:
    """Strategy ``cpmemory``: question + blocks to a ``cpmemory serve`` proxy (see the module docstring).

    ``recording`` is the proxy's transport when the proxy runs in this process (a
    :class:`cpmemory.bench.load.RecordingTransport`): it holds what reached the engine, by request id.
    """

    def __init__(self, base_url: str, *, model: str, max_tokens: int, timeout_s: float, recording: Any = None,
                 transport: Any = None) -> None:
        """Create the HTTP client; no IO."""
        import httpx

        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=1024), transport=transport)
        self.model, self.max_tokens, self.recording = model, max_tokens, recording

    async def send(self, conversation: str, blocks: Sequence[Any], query: str, multi_turn: bool) -> Sent:
        """Send one turn through the proxy (independent requests get a conversation of their own)."""
        del multi_turn  # the caller names a fresh conversation per request when the trace is not multi-turn
        body = {"model": self.model, "messages": [{"role": "user", "content": query}],
                "cpmemory": {"conversation_id": conversation,
                             "blocks": [{"id": block.id, "text": block.text} for block in blocks]},
                "stream_options": {"include_usage": True}, **sampling(self.max_tokens)}
        started = time.perf_counter()
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                raise EngineError(f"proxy answered HTTP {response.status_code}: {text[:300]}")
            replica = int(response.headers.get("X-Cpmemory-Replica", "-1"))
            request_id = response.headers.get("X-Cpmemory-Request-Id", "")
            fit = parse_fit_header(response.headers.get(FIT_HEADER))
            accumulator = await read_stream(response.aiter_bytes(), started)
        sent = None
        if self.recording is not None:
            recorded = self.recording.sent.pop(request_id, None)
            sent = tuple(recorded) if recorded is not None else None
        prompt, cached = _usage(accumulator)
        return Sent(accumulator.first_token_at and accumulator.first_token_at - started,
                    time.perf_counter() - started, prompt, cached, replica, sent, fit=fit)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.client.aclose()


async def reset_prefix_caches(urls: Sequence[str], timeout_s: float = 10.0) -> dict[str, bool]:
    """``POST /reset_prefix_cache`` on every engine at once (vLLM dev mode); url -> whether it was emptied.

    Each call is bounded by ``timeout_s``; never raises.
    """
    import asyncio

    from cpmemory.engines.client import AsyncEngineClient, EngineSettings

    async def one(url: str) -> bool:
        try:
            async with AsyncEngineClient(EngineSettings(base_url=url, timeout_s=timeout_s)) as client:
                return await asyncio.wait_for(client.reset_prefix_cache(attempts=25, wait_s=0.2), 2 * timeout_s + 5)
        except (EngineError, asyncio.TimeoutError):
            return False

    results = await asyncio.gather(*(one(url) for url in urls))
    return dict(zip(urls, results))
