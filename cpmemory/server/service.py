"""The proxy's request logic, independent of FastAPI: turn a chat request into a cpmemory turn and route it.

Flow of a request carrying the ``cpmemory`` extension (or the ``X-Cpmemory-Conversation`` header)::

    [hold while the replicas are full (server.hold), release in planner order]
        -> prepare (facade: dedup, reorder, annotate)
        -> [cache-fit admission (server.fit): a new conversation waits until a replica's cache has room for it]
        -> dispatch to the conversation's replica (failover)
        -> success: commit the answer                  -> failure: abort (the stored state is unchanged)

Without the extension the request is passed through. Routing (``routing.router``): a request that carries no
conversation history (a plain request, a conversation's first turn) goes where its prompt's prefix is cached, load
permitting (the router's prefix view: the replicas' KV events when configured, else what was sent where); a
conversation's later turns keep their replica. Behind a gateway (``upstream``) the gateway picks the replica.
Every request to an engine carries a request id and the tenant's ``cache_salt`` (a client-sent salt is replaced,
so a tenant can never share prefix-cache entries with another).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from cpmemory.core.blocks import Block, to_block
from cpmemory.engines.openai_wire import (
    EngineBody,
    engine_body,
    parse_usage,
    request_headers,
    response_text,
    session_params,
    usage_tokens,
)
from cpmemory.errors import (
    EngineError,
    InvalidInputError,
    NoHealthyReplicaError,
    PromptBudgetError,
    ReservationError,
    StoreUnavailableError,
)
from cpmemory.facade import IndexEvictor
from cpmemory.routing.dispatch import NO_HINT, Dispatcher, DispatchResult, RouteHint, StreamDispatch
from cpmemory.routing.prefix import content_chars, text_blocks
from cpmemory.routing.router import RouteDecision, conversation_affinity_key
from cpmemory.server.budget import MAX_REPLANS, EngineBudget, EngineLimits, requested_answer_tokens, tighter_budget
from cpmemory.server.fit import CALIBRATION_MIN_CHARS, UNGATED, CacheFit, FitSlot
from cpmemory.server.hold import Admission, HoldQueue
from cpmemory.server.metrics import ProxyMetrics
from cpmemory.server.pick import SentOrders
from cpmemory.server.salt import CacheSalts
from cpmemory.server.schemas import ChatCompletionRequest, ChatMessage
from cpmemory.server.sse import SseCollector
from cpmemory.session.config import CpMemoryConfig
from cpmemory.session.turns import BlockDecision, PreparedTurn, turn_counts

logger = logging.getLogger(__name__)
MAX_SERVED_ON = 100_000
"""Conversations whose serving replica behind a gateway the proxy remembers (least recently served dropped first)."""
CALIBRATION_WAIT_S = 2.0
"""How long requests wait for the count that calibrates the token estimate (:meth:`ProxyService.calibrate_estimate`)
before they go on with the default; the count still lands when it answers."""


class TurnMemory(Protocol):
    """What the proxy needs from ``cpmemory.facade.AsyncCpMemory``."""

    config: CpMemoryConfig

    async def prepare(
        self, conversation_id: str, query: str, blocks: Sequence[Block], *,
        history: Sequence[Mapping[str, Any]] | None = None, tenant: str = "default", system_prompt: str | None = None,
    ) -> PreparedTurn: ...

    async def commit(self, turn_or_reservation_id: PreparedTurn, answer: str, *, late: bool = False) -> int: ...

    async def abort(self, turn_or_reservation_id: PreparedTurn) -> bool: ...

    async def evict(self, request_ids: Sequence[str], *, tenant: str = "default") -> int: ...

    def index_evictor(self) -> IndexEvictor: ...


@dataclass(frozen=True, slots=True)
class TurnInput:
    """What the facade's ``prepare`` receives, derived from the chat request."""

    conversation_id: str
    query: str
    blocks: tuple[Block, ...]
    system_prompt: str | None
    history: tuple[dict[str, Any], ...] | None


@dataclass(frozen=True, slots=True)
class OpenedStream:
    """An engine stream the proxy relays: the dispatch, whether to strip the usage the client did not ask for, and
    the hold queue's admission (its slot is given back when the stream is released)."""

    dispatch: StreamDispatch
    strip_usage: bool
    admission: Admission | None = None
    fit: FitSlot = field(default_factory=lambda: UNGATED)
    registration: _Registration | None = None  # a prepared turn's prompt, registered for eviction sync once committed

    @property
    def decision(self) -> RouteDecision:
        """The replica serving the stream."""
        return self.dispatch.decision

    @property
    def engine_seconds(self) -> float:
        """Time spent waiting on engines to open the stream."""
        return self.dispatch.engine_seconds

    @property
    def fit_replica(self) -> int | None:
        """The replica admission counts the turn on (None behind a gateway: the gateway's index is no replica)."""
        return None if self.registration is not None and self.registration.upstream else self.decision.index

    async def release(self) -> None:
        """Close the stream and stop counting it in flight (idempotent)."""
        try:
            await self.dispatch.release()
        finally:
            self.fit.end(self.fit_replica)  # idempotent: relay_stream ends it first, with the usage
            if self.admission is not None:
                self.admission.done()


@dataclass(frozen=True, slots=True)
class _Registration:
    """What eviction sync needs of a sent prompt: where it went and what it was."""

    key: str
    request_id: str
    payload: Mapping[str, Any]
    tenant: str
    hint: RouteHint
    upstream: bool


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """A finished non-streaming turn: the engine's JSON plus the ``cpmemory`` info."""

    body: dict[str, Any]


def message_text(message: ChatMessage) -> str:
    """Return a message's text (text parts joined by line breaks); list content must be text parts only
    (InvalidInputError otherwise)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidInputError("cpmemory turns accept text content only")
        texts.append(part["text"])
    return "\n".join(texts)


def request_chars(request: ChatCompletionRequest, turn: TurnInput | None) -> int:
    """Characters of a request's messages and blocks, before it is prepared (what the token estimate counts)."""
    chars = sum(len(str(message.content or "")) for message in request.messages)
    if turn is not None:
        chars += sum(len(block.text) for block in turn.blocks)
    return chars


def turn_input(request: ChatCompletionRequest, header_conversation: str | None) -> TurnInput:
    """Split a chat request into system prompt, history and query for ``prepare``. Pure.

    Leading system messages form the system prompt. The query is ``cpmemory.query`` when given, else the last
    message's text when it is a user message. Every other message is the client's own history, sent as given
    (every field: tool calls, tool call ids, names, content parts); None when there is none (the stored transcript
    is used). A message is never dropped: with ``cpmemory.query`` a final user message stays in the history.
    Blocks are passed as given (repeated ids are resolved by the facade, one decision per block).

    Raises:
        InvalidInputError: no conversation id, no query, or non-text content in the system prompt or the query.
    """
    extension = request.cpmemory
    conversation_id = (extension.conversation_id if extension else None) or header_conversation
    if not conversation_id:
        raise InvalidInputError("a cpmemory turn needs cpmemory.conversation_id or X-Cpmemory-Conversation")
    messages = list(request.messages)
    system_parts: list[str] = []
    while messages and messages[0].role == "system":
        system_parts.append(message_text(messages.pop(0)))
    query = extension.query if extension else None
    if query is None and messages and messages[-1].role == "user":
        query = message_text(messages.pop())
    if query is None:
        raise InvalidInputError("a cpmemory turn needs a final user message or cpmemory.query")
    history = tuple(message.model_dump(exclude_unset=True) for message in messages)
    blocks = [to_block(block.model_dump()) for block in extension.blocks] if extension else []
    return TurnInput(
        conversation_id, query, tuple(blocks), "\n\n".join(system_parts) or None, history or None
    )


class ProxyService:
    """Per-app state: memory facade, dispatcher, metrics. Use from one event loop."""

    def __init__(self, memory: TurnMemory, dispatcher: Dispatcher, metrics: ProxyMetrics, salts: CacheSalts) -> None:
        """Wire the parts; no IO."""
        self.memory = memory
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.salts = salts
        self.kv_sync: Any = None  # a KVSyncHub when the engines publish KV events (set by the app's lifespan)
        self.upstream = False  # True behind a gateway: it picks the replica, the proxy sends no routing hint
        self.salt_requests = True  # every engine request carries the tenant's cache_salt (ServerConfig.cache_salt)
        self.upstream_session = False  # turns name their conversation to the gateway (ServerConfig.upstream_session)
        self.engine_budget: EngineBudget | None = None  # set by create_app (cpmemory.server.budget)
        self.answer_reserve_tokens = 1024  # answer tokens reserved when a request gives no max_tokens
        self.hold: HoldQueue | None = None  # the hold-and-release queue, when max_in_flight or hold_fit is set
        self.fit: CacheFit | None = None  # cache-fit admission, when the replicas' cache sizes are known (create_app)
        self.sent_orders: SentOrders | None = None  # the block orders sent to each replica (hold_pick)
        self.gateway_replicas = 0  # behind a gateway: the replicas whose KV events tell where a conversation went
        self._served_on: OrderedDict[str, int] = OrderedDict()  # conversation key -> the replica that served it
        self._calibration: asyncio.Future[None] | None = None  # the one count that calibrates the estimate

    @property
    def needs_calibration(self) -> bool:
        """Whether a request should calibrate the token estimate (:meth:`calibrate_estimate`): the hold queue counts
        tokens (``--hold-fit``: it decides on the estimate before any answer), cache-fit admission knows the caches'
        sizes, the proxy can count (``engine_budget``), and no count has answered or failed yet. Without
        ``--hold-fit`` the estimate is left to the answers, as before: first turns never wait for admission, so
        nothing decides on it before an answer."""
        fit, hold = self.fit, self.hold
        return (hold is not None and hold.counts_tokens and fit is not None and fit.sized and not fit.calibrated
                and self.engine_budget is not None and (self._calibration is None or not self._calibration.done()))

    async def calibrate_estimate(self, request: ChatCompletionRequest, turn: TurnInput | None) -> None:
        """While :attr:`needs_calibration`, count one request of ``CALIBRATION_MIN_CHARS`` characters or more (its
        messages, its blocks' texts added to the last one, so roles stay as the chat template expects them) to set
        cache-fit admission's tokens per character, which the hold's token bound uses: the local tokenizer when there is one, else the engine's ``/tokenize``. One count for the
        whole proxy: requests that arrive meanwhile wait for it, at most ``CALIBRATION_WAIT_S``; a count that fails
        is not retried (the answers' usage moves the estimate, as without the count).

        Why. The hold's token bound (``--hold-fit``) and cache-fit admission estimate a prompt's tokens from its
        characters before it is sent; until an answer came back that estimate was the default, four characters a
        token. A burst reaching a fresh proxy arrives before any answer: with the bench model's tokenizer (2.7
        characters a token) the bound let in 8 LoCoMo prompts where the caches hold 6, unplanned."""
        counter, fit = self.engine_budget, self.fit
        if not self.needs_calibration or counter is None or fit is None:
            return
        chars = request_chars(request, turn)
        if chars < CALIBRATION_MIN_CHARS:
            return
        if self._calibration is None:
            messages = [{"role": message.role, "content": str(message.content or "")} for message in request.messages]
            if turn is not None and turn.blocks:
                texts = "\n\n".join(block.text for block in turn.blocks)
                if messages:
                    messages[-1]["content"] = f"{texts}\n\n{messages[-1]['content']}"
                else:
                    messages.append({"role": "user", "content": texts})
            self._calibration = asyncio.ensure_future(self._count_for_calibration(counter, fit, request.model,
                                                                                  messages, chars))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._calibration), CALIBRATION_WAIT_S)

    async def _count_for_calibration(self, counter: EngineBudget, fit: CacheFit, model: str,
                                     messages: Sequence[Mapping[str, str]], chars: int) -> None:
        tokens = await counter.count(model, messages)
        if tokens is None:
            self.metrics.fallbacks.labels(kind="calibrate").inc()
            return
        fit.calibrate(chars, tokens)
        logger.info("token estimate calibrated on one prompt: %.3f tokens per character", fit.tokens_per_char)

    async def route_hint(self, payload: Mapping[str, Any], sticky: bool, remember: bool = True,
                         key: str | None = None, placed: bool = False) -> RouteHint:
        """The router's hint for one engine payload: its prompt blocks (engine hashes when the replicas publish KV
        events and the view follows them, else character chunks) and whether its key is sticky.

        ``placed``: the call's replica is already decided (its split window's lane has one): no engine hashes are
        asked for (its prompt is registered for eviction sync after the answer). A ``/tokenize`` call waits behind
        the engine's prefill on its API server, seconds under a burst, and a released window is sent one request
        after the other: a slow one let the next ones overtake it (``SEND_TURN_S``) and the engines queued the lanes
        out of their planned order.

        Engine hashes cost a ``/tokenize`` call before the request can be sent; a sticky call whose replica the
        router keeps (``Router.sticky_replica``) skips it (its prompt is registered for eviction sync after the
        answer instead). A tokenization that fails gives no blocks: the router then keeps sticky keys where they
        are and routes the others by key (counted as the ``route_tokenize`` fallback).
        """
        router = self.dispatcher.router
        if self.upstream or router.view is None or router.config.policy == "affinity":
            return RouteHint(None, sticky, remember)
        if self.kv_sync is not None and getattr(self.kv_sync, "view", None) is router.view:
            if placed or (sticky and key is not None and router.sticky_replica(key) is not None):
                return RouteHint(None, sticky, remember)
            # the least loaded replica in rotation tokenizes (its API server is the least busy)
            healthy = [status.url for status in sorted(router.status(), key=lambda status: status.in_flight)
                       if status.healthy]
            blocks = await self.kv_sync.prompt_blocks(payload, healthy)
            if blocks is None:
                self.metrics.fallbacks.labels(kind="route_tokenize").inc()
            return RouteHint(blocks, sticky, remember)
        return RouteHint(text_blocks(payload.get("messages") or []), sticky, remember)

    def _lane_replica(self, admission: Admission | None, sticky: bool) -> tuple[int | None, bool]:
        """(the healthy replica the call's split-window lane runs on, or None; whether the call belongs to a lane the
        proxy places at all: split, not sticky, not behind a gateway)."""
        if admission is None or admission.lane is None or admission.lanes is None or self.upstream or sticky:
            return None, False
        router = self.dispatcher.router
        replica = admission.lanes.replica(admission.lane)
        return (replica if replica is not None and router.is_healthy(router.urls[replica]) else None), True

    def lane_placed(self, admission: Admission | None, sticky: bool) -> bool:
        """Whether the call's split-window lane already runs on a healthy replica (:meth:`lane_hint` will send it
        there without asking the router)."""
        return self._lane_replica(admission, sticky)[0] is not None

    def lane_hint(self, admission: Admission | None, key: str, hint: RouteHint) -> RouteHint:
        """The hint of a call whose held window was split over the replicas (``Admission.lane``): its lane's
        replica; the lane's first call claims the router's choice among the replicas no other lane of its release
        holds (any healthy one when all are held). A sticky call (its history is where it is), a call behind a
        gateway, or one not split: the hint unchanged."""
        replica, placed = self._lane_replica(admission, hint.sticky)
        if not placed:
            return hint
        assert admission is not None and admission.lanes is not None and admission.lane is not None
        if replica is None:
            router = self.dispatcher.router
            taken = [router.urls[index] for index in admission.lanes.taken(admission.lane)]
            try:
                try:
                    replica = router.choose(key, exclude=taken, prompt=hint.prompt).index
                except NoHealthyReplicaError:  # every free replica is down: share one with another lane
                    replica = router.choose(key, prompt=hint.prompt).index
            except NoHealthyReplicaError:
                return hint  # the dispatcher reports it
            admission.lanes.claim(admission.lane, replica)
        return replace(hint, replica=replica, placed_by="lane")

    def cache_salt(self, tenant: str) -> str | None:
        """The tenant's vLLM ``cache_salt``: a keyed hash of the tenant, stable across restarts (see ``salt``);
        None when salts are off (``ServerConfig.cache_salt``)."""
        return self.salts.salt(tenant) if self.salt_requests else None

    def _name_session(self, body: dict[str, Any], key: str, admission: Admission | None = None,
                      sticky: bool = False) -> None:
        """Behind a gateway with ``upstream_session``: the turn names its conversation (``session_params``), or, a
        turn without history of a split held window, its lane (so the gateway keeps the lane on one replica)."""
        if self.upstream and self.upstream_session:
            lanes = admission.lanes if admission is not None else None
            if lanes is not None and admission is not None and admission.lane is not None and not sticky:
                key = lanes.session_key(admission.lane)
            body["session_params"] = session_params(key)

    def engine_payload(
        self, request: ChatCompletionRequest, messages: Sequence[Mapping[str, str]] | None, request_id: str,
        tenant: str,
    ) -> EngineBody:
        """The body sent to the engine: the client's fields, our messages, request id and the tenant's salt.

        A stream always asks for usage (the metrics count cached tokens); ``strip_usage`` says whether the client
        asked for it too (see :func:`cpmemory.engines.openai_wire.engine_body`).
        """
        client_body = request.model_dump(exclude_unset=True, exclude={"cpmemory"})
        client_body["model"] = request.model
        return engine_body(client_body, request_id=request_id, cache_salt=self.cache_salt(tenant), messages=messages)

    async def prepare(
        self, tenant: str, turn: TurnInput, request: ChatCompletionRequest | None = None
    ) -> PreparedTurn:
        """Run the facade's prepare (InvalidInputError propagates: nothing was stored).

        With ``request`` and an engine that reports ``max_model_len``, the prompt fits ``max_model_len`` minus the
        request's answer tokens, counted by the engine's ``/tokenize`` when it offers it (cpmemory.server.budget).
        """
        budget = None
        limits = None
        if request is not None and self.engine_budget is not None:
            limits = await self.engine_budget.limits(request.model)
            if limits.max_model_len is not None:
                answer = requested_answer_tokens(request, self.answer_reserve_tokens)
                budget = max(1, limits.max_model_len - answer)
        planning = budget
        if budget is not None and request is not None and self.engine_budget is not None:
            planning = self.engine_budget.planning_budget(request.model, budget)
        prepared = await self._prepare_once(tenant, turn, planning)
        if budget is None or limits is None or not limits.tokenize:
            return prepared
        return await self._fit_engine_count(tenant, turn, request, budget, prepared, limits)

    async def _prepare_once(self, tenant: str, turn: TurnInput, budget: int | None) -> PreparedTurn:
        options: dict[str, Any] = {} if budget is None else {"max_prompt_tokens": budget}
        return await self.memory.prepare(
            turn.conversation_id, turn.query, list(turn.blocks), history=list(turn.history) if turn.history else None,
            tenant=tenant, system_prompt=turn.system_prompt, **options,
        )

    async def _fit_engine_count(self, tenant: str, turn: TurnInput, request: Any, budget: int, prepared: Any,
                                limits: EngineLimits) -> Any:
        """Replan (tighter) until the engine's own count of the prompt fits ``budget``; PromptBudgetError if not."""
        assert self.engine_budget is not None
        for _ in range(MAX_REPLANS + 1):
            planned = prepared.prompt_tokens or budget
            if not self.engine_budget.should_count(request.model, planned, budget,
                                                   limits.upper_bound(prepared.messages)):
                return prepared
            count = await self.engine_budget.count(request.model, prepared.messages)
            if count is None:
                return prepared
            self.engine_budget.observe(request.model, planned, count)
            if count <= budget:
                return prepared
            await self.abort(prepared)
            tighter = tighter_budget(budget, planned, count)
            self.metrics.fallbacks.labels(kind="budget_replan").inc()
            prepared = await self._prepare_once(tenant, turn, tighter)
        await self.abort(prepared)
        raise PromptBudgetError(f"the engine counts the prompt over its budget of {budget} tokens", budget)

    async def pass_through(self, request: ChatCompletionRequest, tenant: str) -> DispatchResult:
        """Forward a plain request to the replica of its prefix-affinity key."""
        await self.salts.ready()
        request_id = "cpm-" + uuid.uuid4().hex
        payload = self.engine_payload(request, None, request_id, tenant).body
        hint = await self.route_hint(payload, sticky=False, remember=False)
        result = await self.dispatcher.complete(prefix_key(tenant, request), payload, request_headers(request_id),
                                                hint)
        self._count_engine(result.decision, result.failovers, result.response.get("usage"), hint)
        return result

    async def open_pass_through_stream(self, request: ChatCompletionRequest, tenant: str) -> OpenedStream:
        """Open a plain streaming request on the replica of its prefix-affinity key."""
        await self.salts.ready()
        request_id = "cpm-" + uuid.uuid4().hex
        payload = self.engine_payload(request, None, request_id, tenant)
        hint = await self.route_hint(payload.body, sticky=False, remember=False)
        opened = await self.dispatcher.open_stream(prefix_key(tenant, request), payload.body,
                                                   request_headers(request_id), hint)
        return OpenedStream(opened, payload.strip_usage)

    async def run_turn(
        self, request: ChatCompletionRequest, tenant: str, turn: TurnInput, prepared: PreparedTurn, started: float,
        admission: Admission | None = None,
    ) -> TurnOutcome:
        """Send a prepared turn, then commit (success) or abort (any failure, re-raised: an engine error, or a
        request that cannot be encoded, InvalidInputError). ``admission``: its hold queue's (a split window's lane)."""
        await self.salts.ready()
        request_id = engine_request_id(prepared)
        payload = self.engine_payload(request, prepared.messages, request_id, tenant).body
        key = conversation_affinity_key(tenant, turn.conversation_id)
        self._name_session(payload, key, admission, has_history(turn, prepared))
        slot = UNGATED
        try:
            hint = await self.route_hint(payload, has_history(turn, prepared), key=key,
                                         placed=self.lane_placed(admission, has_history(turn, prepared)))
            hint = self.lane_hint(admission, key, hint)
            slot, hint = await self.place(key, payload, hint, request)
            self.record_sent(hint.replica, turn, prepared)
            if admission is not None and hint.replica is not None and not self.upstream:
                admission.placed(hint.replica)
            result = await self.dispatcher.complete(key, payload, request_headers(request_id), hint)
        except BaseException as error:
            slot.end()
            await self.abort(prepared)
            if isinstance(error, EngineError):
                self.metrics.requests.labels(replica="none", outcome="engine_error").inc()
            raise
        if hint.replica is None or hint.replica != result.decision.index:
            self.record_sent(result.decision.index, turn, prepared)
        slot.end(None if self.upstream else result.decision.index, *answer_usage(result.response.get("usage")))
        self._learn_tokens(payload.get("model"), prepared, result.response.get("usage"))
        committed = await self.commit(prepared, response_text(result.response))
        if committed:
            self._register(result.decision.index, _Registration(key, request_id, payload, tenant, hint, self.upstream))
        self._count_engine(result.decision, result.failovers, result.response.get("usage"), hint)
        overhead = time.perf_counter() - started - result.engine_seconds - slot.waited_s  # a wait has its histogram
        info = self.turn_info(turn, prepared, result.decision, result.failovers, result.response.get("usage"),
                              committed, overhead)
        return TurnOutcome({**result.response, "cpmemory": info})

    async def open_turn_stream(self, request: ChatCompletionRequest, tenant: str, turn: TurnInput,
                               prepared: PreparedTurn, admission: Admission | None = None) -> OpenedStream:
        """Open the engine stream of a prepared turn; abort the turn if it cannot be sent (re-raised).
        ``admission``: its hold queue's (a split window's lane)."""
        await self.salts.ready()
        request_id = engine_request_id(prepared)
        payload = self.engine_payload(request, prepared.messages, request_id, tenant)
        key = conversation_affinity_key(tenant, turn.conversation_id)
        self._name_session(payload.body, key, admission, has_history(turn, prepared))
        slot = UNGATED
        try:
            hint = await self.route_hint(payload.body, has_history(turn, prepared), key=key,
                                         placed=self.lane_placed(admission, has_history(turn, prepared)))
            hint = self.lane_hint(admission, key, hint)
            slot, hint = await self.place(key, payload.body, hint, request)
            opened = await self.dispatcher.open_stream(key, payload.body, request_headers(request_id), hint)
        except BaseException:
            slot.end()
            await self.abort(prepared)
            raise
        self.record_sent(opened.decision.index, turn, prepared)
        if admission is not None and not self.upstream:
            admission.placed(opened.decision.index)
        return OpenedStream(opened, payload.strip_usage, fit=slot,
                            registration=_Registration(key, request_id, payload.body, tenant, hint, self.upstream))

    def record_sent(self, replica: int | None, turn: TurnInput, prepared: PreparedTurn) -> None:
        """Note in the view ``hold_pick`` picks by (``sent_orders``) the block order of a prompt sent to
        ``replica``, when the prompt opens its conversation (its blocks follow the system prompt, so their order is
        a prefix the engine caches). Nothing behind a gateway, for a degraded turn or with the view off."""
        view = self.sent_orders
        if view is None or replica is None or self.upstream or prepared.degraded or not prepared.opens_conversation:
            return
        by_id = {block.id: block for block in turn.blocks}
        shown = [by_id[block_id] for block_id in prepared.prompt_order if block_id in by_id]
        view.record(replica, [block.content_hash for block in shown], [len(block.text) + 1 for block in shown])

    def arrived(self, tenant: str, turn: TurnInput) -> None:
        """A turn reached the proxy (before it is held and prepared): cache-fit admission keeps its conversation's
        place meanwhile (``CacheFit.touch``)."""
        if self.fit is not None:
            self.fit.touch(conversation_affinity_key(tenant, turn.conversation_id))

    async def place(self, key: str, payload: Mapping[str, Any], hint: RouteHint, request: ChatCompletionRequest
                    ) -> tuple[FitSlot, RouteHint]:
        """Cache-fit admission of a turn (cpmemory.server.fit): waits while no replica's cache has room for a new
        conversation; returns its slot and the hint, with the replica it was placed on. Off: at once, unchanged."""
        fit = self.fit
        router = self.dispatcher.router
        healthy = [status.index for status in router.status() if status.healthy]
        if fit is None or not fit.sized or not healthy:
            return UNGATED, hint
        if self.upstream and self.gateway_replicas:  # the gateway picks; its replica is known after a first turn
            known = self._served_on.get(key)
            ranked = [known] if known is not None else fit.by_room(range(self.gateway_replicas))
        elif self.upstream:  # the gateway picks the replica: one pool, the fleet's cache
            ranked = [0]
        elif hint.sticky and fit.replica_of(key) in healthy:  # a live conversation stays: no routing choice needed
            ranked = healthy
        elif hint.replica is not None and hint.replica in healthy:  # its lane's replica (a held window's split)
            ranked = [hint.replica, *(index for index in healthy if index != hint.replica)]
        else:
            try:
                first = router.choose(key, prompt=hint.prompt, sticky=hint.sticky).index
            except NoHealthyReplicaError:
                return UNGATED, hint
            ranked = [first, *(index for index in healthy if index != first)]
        chars = content_chars(payload.get("messages") or [])
        slot = await fit.admit(key, chars, requested_answer_tokens(request, self.answer_reserve_tokens), ranked,
                               history=hint.sticky)
        if self.upstream or slot.reason in ("first", "timeout"):  # the gateway's, or the router's choice
            return slot, hint
        if slot.reason == "room" and slot.replica == ranked[0] and not slot.waited_s:
            return slot, hint  # the router's choice, its view fresh
        return slot, replace(hint, replica=slot.replica, placed_by="fit")  # the conversation's (it may have moved)

    def _register(self, replica: int, sent: _Registration) -> None:
        """Register a committed prompt for eviction sync: its known hashes, else a background ``/tokenize``; behind
        a gateway whose replicas' events the proxy follows, find the replica that served it first (and count the
        conversation there for cache-fit admission)."""
        hub = self.kv_sync
        if hub is None:
            return
        if sent.upstream and self.gateway_replicas:
            hub.attribute_later(sent.request_id, sent.payload, sent.tenant,
                                lambda served: self._served(sent.key, served))
        elif sent.hint.prompt is not None and hub.view is not None and not sent.upstream:
            hub.register_hashes(replica, sent.request_id, sent.hint.prompt.keys, sent.tenant)
        else:
            hub.register_later(None if sent.upstream else replica, sent.request_id, sent.payload, sent.tenant)

    def _served(self, key: str, replica: int | None) -> None:
        """Behind a gateway: conversation ``key``'s last turn was served by ``replica`` (None: not found out)."""
        self.metrics.gateway_attributions.labels(replica="unknown" if replica is None else str(replica)).inc()
        if replica is None:
            return
        self._served_on[key] = replica
        self._served_on.move_to_end(key)
        while len(self._served_on) > MAX_SERVED_ON:
            self._served_on.popitem(last=False)
        if self.fit is not None:
            self.fit.move(key, replica)

    async def relay_stream(
        self, opened: OpenedStream, prepared: PreparedTurn | None, overhead_s: float
    ) -> AsyncIterator[bytes]:
        """Relay the engine's events (less the usage the client did not ask for); at the end commit choice 0's
        answer (clean end) or abort (anything else)."""
        collector = SseCollector(strip_usage=opened.strip_usage)
        try:
            async for chunk in opened.dispatch.stream.aiter_bytes():
                relayed = collector.feed(chunk)
                if relayed:
                    yield relayed
            rest = collector.flush()
            if rest:
                yield rest
        except EngineError as error:
            collector.broken = True
            yield b'data: {"error": {"type": "engine_error", "code": "stream_broken", "message": "' + \
                type(error).__name__.encode() + b'"}}\n\n'
        finally:
            opened.fit.end(opened.fit_replica, *answer_usage(collector.usage))
            await opened.release()
            await self._finish_stream(opened, prepared, collector, overhead_s)

    async def _finish_stream(
        self, opened: OpenedStream, prepared: PreparedTurn | None, collector: SseCollector, overhead_s: float
    ) -> None:
        started = time.perf_counter()
        if prepared is not None:
            if collector.complete:
                if opened.registration is not None:
                    self._learn_tokens(opened.registration.payload.get("model"), prepared, collector.usage)
                if await self.commit(prepared, collector.answer) and opened.registration is not None:
                    self._register(opened.decision.index, opened.registration)
            else:
                await self.abort(prepared)
        self._count_engine(opened.decision, opened.dispatch.failovers, collector.usage)
        self.metrics.overhead.observe(overhead_s + time.perf_counter() - started)

    def _learn_tokens(self, model: Any, prepared: PreparedTurn, usage: Any) -> None:
        """An answered prompt's engine count (``usage.prompt_tokens``) against the facade's planned size: what the
        prompt budget learns its counter's ratio from, at no cost (``EngineBudget.learn``)."""
        if self.engine_budget is not None and isinstance(model, str):
            self.engine_budget.learn(model, prepared.prompt_tokens, usage_tokens({"usage": usage})[0])

    async def commit(self, prepared: PreparedTurn, answer: str) -> bool:
        """Commit the turn; a store failure is logged and counted, never raised. A turn whose reservation timed out
        while it waited or streamed (admission, a queued engine, a long answer) is committed late all the same: the
        proxy ends every turn it prepared, so the expiry would only drop an answered turn from the history."""
        try:
            await self.memory.commit(prepared, answer, late=True)
        except (StoreUnavailableError, ReservationError) as error:
            logger.warning("commit of %s failed: %s", prepared.request_id or prepared.reservation_id, error)
            self.metrics.fallbacks.labels(kind="store").inc()
            return False
        return True

    async def abort(self, prepared: PreparedTurn) -> None:
        """Release the turn's reservation; failures are logged (the reservation expires on its own)."""
        try:
            await self.memory.abort(prepared)
        except (StoreUnavailableError, ReservationError) as error:
            logger.warning("abort of %s failed: %s", prepared.request_id or prepared.reservation_id, error)

    def turn_info(
        self, turn: TurnInput, prepared: PreparedTurn, decision: RouteDecision, failovers: int, usage: Any, committed: bool,
        overhead_s: float,
    ) -> dict[str, Any]:
        """The ``cpmemory`` field of a response; also records the turn's metrics."""
        prompt_tokens, cached_tokens = usage_tokens({"usage": usage})
        decisions = [decision_dict(item) for item in prepared.decisions]
        deduplicated = turn_counts(prepared, self.memory.config.chars_per_token)["dedup_tokens_saved"]
        self.metrics.tokens_deduplicated.inc(deduplicated)
        self.metrics.observe_blocks([item["status"] for item in decisions])
        self.metrics.overhead.observe(max(0.0, overhead_s))
        degraded = prepared.degraded
        if degraded:  # the store was down at prepare: the turn went through in full and nothing was recorded
            self.metrics.fallbacks.labels(kind="store").inc()
            committed = False
        return {
            "conversation_id": turn.conversation_id, "turn": prepared.turn,
            "request_id": engine_request_id(prepared), "replica": decision.index, "route_reason": decision.reason,
            "failovers": failovers, "decisions": decisions, "cached_tokens": cached_tokens,
            "prompt_tokens": prompt_tokens, "tokens_deduplicated": deduplicated, "degraded": degraded,
            "committed": committed, "overhead_ms": round(max(0.0, overhead_s) * 1000, 3),
            "prompt_budget": prepared.budget,
        }

    def _count_engine(self, decision: RouteDecision, failovers: int, usage: Any, hint: RouteHint = NO_HINT) -> None:
        prompt_tokens, cached_tokens = usage_tokens({"usage": usage})
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_tokens.inc(cached_tokens)
        self.metrics.requests.labels(replica=str(decision.index), outcome="ok").inc()
        share = hint.prompt.fraction(decision.cached_blocks) if hint.prompt is not None else None
        self.metrics.observe_decision(decision.index, decision.reason, share)
        if failovers:
            self.metrics.fallbacks.labels(kind="engine").inc(failovers)
        if decision.reason == "load":
            self.metrics.fallbacks.labels(kind="load").inc()
        self.metrics.healthy_replicas.set(self.dispatcher.router.healthy_count())


def answer_usage(usage: Any) -> tuple[int | None, int]:
    """(prompt tokens or None, completion tokens or 0) of an engine's ``usage`` object (``parse_usage``)."""
    parsed = parse_usage(usage)
    return parsed.prompt_tokens, parsed.completion_tokens or 0


def has_history(turn: TurnInput, prepared: PreparedTurn) -> bool:
    """Whether a turn carries conversation history (a later turn, or the client's own transcript)."""
    return bool(turn.history) or prepared.turn > 1


def engine_request_id(prepared: PreparedTurn) -> str:
    """The request id sent to the engine: the turn's index leaf id, or a fresh one when nothing was indexed."""
    if prepared.request_id:
        return prepared.request_id
    reservation = prepared.reservation_id or uuid.uuid4().hex
    return f"cpm-{reservation}"


def decision_dict(item: BlockDecision) -> dict[str, Any]:
    """A BlockDecision as a JSON-ready dict."""
    return {
        "block_id": str(item.block_id), "label": str(item.label), "status": str(item.status),
        "original_rank": int(item.original_rank),
        "prompt_position": None if item.prompt_position is None else int(item.prompt_position),
        "saved_chars": int(item.saved_chars),
        "duplicate_of": item.duplicate_of,
    }


def prefix_key(tenant: str, request: ChatCompletionRequest) -> str:
    """Affinity key of a plain request: the tenant and its first message (the prefix most likely cached)."""
    first = request.messages[0]
    text = first.content if isinstance(first.content, str) else repr(first.content)
    digest = hashlib.blake2b(text[:4096].encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return conversation_affinity_key(tenant, "prefix:" + digest)
