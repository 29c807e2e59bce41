"""The facade path to a hosted provider: cpmemory prepares the turn, the provider answers, cpmemory commits.

    from cpmemory import CpMemory
    from cpmemory.hosted import HostedChat, HostedSettings

    chat = HostedChat(HostedSettings(provider="anthropic", api_key="...", model="claude-sonnet-4-5"), CpMemory())
    turn = chat.turn("chat-42", "Where does Alice live?", blocks)
    print(turn.answer, turn.info["cached_input_tokens"], turn.info["estimated_input_cost"])

A call whose messages were built elsewhere (a framework adapter's ``chat_messages``) goes through :meth:`send`.
Every call reports the provider's cache counts and the estimated input cost (``HostedTurn.info``); ``totals`` sums
them. Errors: ``EngineUnreachableError`` / ``EngineStatusError`` as from an engine; the turn is then aborted.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cpmemory.errors import EngineStatusError, EngineUnreachableError, MissingDependencyError
from cpmemory.facade import AsyncCpMemory, CpMemory
from cpmemory.hosted.openai_body import conversation_cache_key
from cpmemory.hosted.prices import HostedUsage, UsageTotals
from cpmemory.hosted.provider import HostedProvider, HostedRequest, HostedSettings
from cpmemory.hosted.transport import GATEWAY_STATUSES
from cpmemory.session.turns import PreparedTurn

__all__ = ["AsyncHostedChat", "HostedChat", "HostedTurn"]


@dataclass(frozen=True, slots=True)
class HostedTurn:
    """One answered call.

    Attributes:
        answer: the answer's text.
        response: the OpenAI-style chat completion.
        usage: the provider's token counts.
        info: what the call reports (provider, model, tokens by kind, ``estimated_input_cost``, breakpoints).
        prepared: the cpmemory turn (None for :meth:`HostedChat.send`).
        committed: the turn number committed (0 when nothing was committed).
    """

    answer: str
    response: dict[str, Any]
    usage: HostedUsage
    info: dict[str, Any]
    prepared: PreparedTurn | None = None
    committed: int = 0


def _request(provider: HostedProvider, messages: Sequence[Mapping[str, Any]], model: str | None,
             conversation_id: str | None, tenant: str, options: Mapping[str, Any]) -> HostedRequest:
    body = {**options, "messages": [dict(message) for message in messages]}
    if model is not None:
        body["model"] = model
    key = conversation_cache_key(tenant, conversation_id) if conversation_id is not None else None
    return provider.request(body, cache_key=key)


def _answered(provider: HostedProvider, totals: UsageTotals, request: HostedRequest, response: Any) -> HostedTurn:
    """The turn of a provider's HTTP response (raises the engine errors on an error status). Mutates ``totals``."""
    if response.status_code in GATEWAY_STATUSES:
        raise EngineUnreachableError(f"{provider.name} answered HTTP {response.status_code}")
    if response.status_code >= 400:
        raise EngineStatusError(response.status_code, response.content, request.url)
    try:
        payload = response.json()
    except ValueError as error:
        raise EngineUnreachableError(f"{provider.name} sent non-JSON") from error
    answer, usage = provider.response(payload, created=int(time.time()))
    used_model = str(answer.get("model") or request.body.get("model") or "")
    totals.add(usage, provider.price(used_model))
    info = provider.turn_info(usage, used_model, request.breakpoints)
    text = str(answer["choices"][0]["message"].get("content") or "")
    return HostedTurn(text, answer, usage, info)


class HostedChat:
    """Turns of cpmemory conversations answered by a hosted provider (sync; one HTTP client, pooled)."""

    def __init__(self, settings: HostedSettings, memory: CpMemory | None = None, *, http_client: Any = None,
                 timeout_s: float = 120.0) -> None:
        """No IO. ``http_client``: an ``httpx.Client`` (tests pass one over a mock provider)."""
        try:
            import httpx
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("engines", "httpx") from error
        self._httpx = httpx
        self.memory = memory if memory is not None else CpMemory()
        self.provider = HostedProvider(settings)
        self._client = http_client or httpx.Client()
        self._owns_client = http_client is None
        self._timeout_s = timeout_s
        self.totals = UsageTotals()

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> HostedChat:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
             conversation_id: str | None = None, tenant: str = "default", **options: Any) -> HostedTurn:
        """Send ``messages`` as they are (a conversation's key when ``conversation_id`` is given, else the shared
        prefix's). Mutates ``totals``."""
        request = _request(self.provider, messages, model, conversation_id, tenant, options)
        try:
            response = self._client.post(request.url, json=request.body, headers=request.headers,
                                         timeout=self._timeout_s)
        except self._httpx.HTTPError as error:
            raise EngineUnreachableError(f"{self.provider.name} unreachable: {type(error).__name__}") from error
        return _answered(self.provider, self.totals, request, response)

    def turn(self, conversation_id: str, query: str, blocks: Iterable[Any], *, model: str | None = None,
             tenant: str = "default", history: Iterable[Mapping[str, Any]] | None = None,
             system_prompt: str | None = None, **options: Any) -> HostedTurn:
        """Prepare a turn (dedup, order), send it, commit the answer (abort on any failure, re-raised)."""
        prepared = self.memory.prepare(conversation_id, query, blocks, history=history, tenant=tenant,
                                       system_prompt=system_prompt)
        try:
            sent = self.send(prepared.messages, model=model, conversation_id=conversation_id, tenant=tenant,
                             **options)
        except BaseException:
            self.memory.abort(prepared)
            raise
        committed = self.memory.commit(prepared, sent.answer)
        return HostedTurn(sent.answer, sent.response, sent.usage, sent.info, prepared, committed)


class AsyncHostedChat:
    """:class:`HostedChat` for asyncio applications (an ``AsyncCpMemory``, an ``httpx.AsyncClient``)."""

    def __init__(self, settings: HostedSettings, memory: AsyncCpMemory | None = None, *, http_client: Any = None,
                 timeout_s: float = 120.0) -> None:
        """No IO. ``http_client``: an ``httpx.AsyncClient`` (tests pass one over a mock provider)."""
        try:
            import httpx
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("engines", "httpx") from error
        self._httpx = httpx
        self.memory = memory if memory is not None else AsyncCpMemory()
        self.provider = HostedProvider(settings)
        self._client = http_client or httpx.AsyncClient()
        self._owns_client = http_client is None
        self._timeout_s = timeout_s
        self.totals = UsageTotals()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def send(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
                   conversation_id: str | None = None, tenant: str = "default", **options: Any) -> HostedTurn:
        """See :meth:`HostedChat.send`."""
        request = _request(self.provider, messages, model, conversation_id, tenant, options)
        try:
            response = await self._client.post(request.url, json=request.body, headers=request.headers,
                                               timeout=self._timeout_s)
        except self._httpx.HTTPError as error:
            raise EngineUnreachableError(f"{self.provider.name} unreachable: {type(error).__name__}") from error
        return _answered(self.provider, self.totals, request, response)

    async def turn(self, conversation_id: str, query: str, blocks: Iterable[Any], *, model: str | None = None,
                   tenant: str = "default", history: Iterable[Mapping[str, Any]] | None = None,
                   system_prompt: str | None = None, **options: Any) -> HostedTurn:
        """See :meth:`HostedChat.turn`."""
        prepared = await self.memory.prepare(conversation_id, query, blocks, history=history, tenant=tenant,
                                             system_prompt=system_prompt)
        try:
            sent = await self.send(prepared.messages, model=model, conversation_id=conversation_id, tenant=tenant,
                                   **options)
        except BaseException:
            await self.memory.abort(prepared)
            raise
        committed = await self.memory.commit(prepared, sent.answer)
        return HostedTurn(sent.answer, sent.response, sent.usage, sent.info, prepared, committed)
