"""The proxy's request logic, independent of FastAPI: turn a chat request into a cpmemory turn and route it.

Flow of a request carrying the ``cpmemory`` extension (or the ``X-Cpmemory-Conversation`` header)::

    [hold while the replicas are full (server.hold), release in planner order]
        -> prepare (facade: a resent history reconciled with the transcript, dedup, reorder, annotate;
                    the store unreachable: a pass-through with the conversation's local history)
        -> [cache-fit admission (server.fit): a new conversation waits until a replica's cache has room for it]
        -> dispatch to the conversation's replica (failover)
        -> success: commit the answer                  -> failure: abort (the stored state is unchanged)

Without the extension the request is passed through. Routing (``routing.router``): a request that carries no
conversation history (a plain request, a conversation's first turn) goes where its prompt's prefix is cached, load
permitting (the router's prefix view: the replicas' KV events when configured, else what was sent where); a
conversation's later turns keep their replica. Behind a gateway (``upstream``) the gateway picks the replica.
Every request to an engine carries a request id and the tenant's ``cache_salt`` (a client-sent salt is replaced,
so a tenant can never share prefix-cache entries with another). Where a turn goes is :mod:`server.placement`; how a
chat request becomes a turn, :mod:`server.turn_request`.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cpmemory.core.blocks import Block
from cpmemory.engines.openai_wire import (
    EngineBody,
    engine_body,
    request_headers,
    response_text,
    usage_tokens,
)
from cpmemory.errors import (
    EngineError,
    PromptBudgetError,
    ReservationError,
    StoreUnavailableError,
)
from cpmemory.facade import IndexEvictor
from cpmemory.hosted.transport import upstream_info
from cpmemory.routing.dispatch import NO_HINT, Dispatcher, DispatchResult, RouteHint, StreamDispatch
from cpmemory.routing.router import RouteDecision, conversation_affinity_key
from cpmemory.server.budget import MAX_REPLANS, EngineLimits, requested_answer_tokens, tighter_budget
from cpmemory.server.fit import UNGATED, FitSlot
from cpmemory.server.hold import Admission
from cpmemory.server.metrics import ProxyMetrics
from cpmemory.server.placement import TurnPlacement, _Registration
from cpmemory.server.salt import CacheSalts
from cpmemory.server.schemas import ChatCompletionRequest
from cpmemory.server.sse import SseCollector
from cpmemory.server.turn_request import (  # noqa: F401 - re-exported (the app imports them from here)
    TurnInput,
    answer_usage,
    decision_dict,
    engine_request_id,
    has_history,
    message_text,
    prefix_key,
    request_chars,
    turn_input,
)
from cpmemory.session.config import CpMemoryConfig
from cpmemory.session.turns import PreparedTurn, turn_counts

logger = logging.getLogger(__name__)


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
class TurnOutcome:
    """A finished non-streaming turn: the engine's JSON plus the ``cpmemory`` info."""

    body: dict[str, Any]


class ProxyService(TurnPlacement):
    """Per-app state: memory facade, dispatcher, metrics. Use from one event loop."""

    def __init__(self, memory: TurnMemory, dispatcher: Dispatcher, metrics: ProxyMetrics, salts: CacheSalts) -> None:
        """Wire the parts; no IO."""
        super().__init__(dispatcher, metrics)
        self.memory = memory
        self.salts = salts
        self.salt_requests = True  # every engine request carries the tenant's cache_salt (ServerConfig.cache_salt)

    def cache_salt(self, tenant: str) -> str | None:
        """The tenant's vLLM ``cache_salt``: a keyed hash of the tenant, stable across restarts (see ``salt``);
        None when salts are off (``ServerConfig.cache_salt``)."""
        return self.salts.salt(tenant) if self.salt_requests else None

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
        if budget is not None and limits is not None and limits.tokenize:
            prepared = await self._fit_engine_count(tenant, turn, request, budget, prepared, limits)
        self._count_history(prepared)
        return prepared

    def _count_history(self, prepared: PreparedTurn) -> None:
        """How the turn used the client's history, and what its prompt left out (``/metrics``)."""
        self.metrics.history_reconciled.labels(outcome=prepared.history).inc()
        messages, turns = prepared.history_dropped
        if messages:
            self.metrics.history_dropped.labels(unit="messages").inc(messages)
            self.metrics.history_dropped.labels(unit="turns").inc(turns)

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
        # admission's waits by design (hold, cache fit), reported apart from the proxy's own time (overhead_ms)
        info["wait_ms"] = round((slot.waited_s + (admission.waited_s if admission is not None else 0.0)) * 1000, 3)
        return TurnOutcome({**result.response, "cpmemory": {**upstream_info(result.response), **info}})

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
                # counted as a whole answer's turn is (turn_info)
                self.metrics.tokens_deduplicated.inc(
                    turn_counts(prepared, self.memory.config.chars_per_token)["dedup_tokens_saved"])
                self.metrics.observe_blocks([decision_dict(item)["status"] for item in prepared.decisions])
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
        kept = degraded and committed  # the store was down: kept by the facade, written back when it returns
        if degraded:  # the store was down at prepare: the turn went through in full, with the local history
            self.metrics.fallbacks.labels(kind="store").inc()
            committed = False
        messages, turns = prepared.history_dropped
        return {
            "conversation_id": turn.conversation_id, "turn": prepared.turn,
            "request_id": engine_request_id(prepared), "replica": decision.index, "route_reason": decision.reason,
            "failovers": failovers, "decisions": decisions, "cached_tokens": cached_tokens,
            "prompt_tokens": prompt_tokens, "tokens_deduplicated": deduplicated, "degraded": degraded,
            "committed": committed, "overhead_ms": round(max(0.0, overhead_s) * 1000, 3),
            "prompt_budget": prepared.budget, "history": prepared.history,
            "history_dropped": {"messages": messages, "turns": turns}, "kept_locally": kept,
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
