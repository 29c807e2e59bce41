"""The OpenAI-compatible proxy (FastAPI app factory). Needs the ``server`` extra.

Endpoints:
  * ``POST /v1/chat/completions`` - OpenAI chat completions, streaming or not. With the ``cpmemory`` extension field
    (or the ``X-Cpmemory-Conversation`` header) the call becomes a cpmemory turn (dedup, reorder, annotate, commit);
    without it the request passes through to a replica chosen by prefix affinity.
  * the operational endpoints (cpmemory.server.operations): ``POST /v1/cpmemory/evictions``, ``GET /livez``,
    ``GET /readyz``, ``GET /healthz``, ``GET /metrics``, and ``GET /v1/models`` relayed from the engines.

Errors produced by the proxy itself have a typed body (cpmemory.server.responses): 400 bad input, 401 unknown API
key, 413 body too large, 422 malformed JSON / schema, 502 engine failure, 503 no healthy replica. A rejected request
changes no stored state. How the parts are built from the configuration: cpmemory.server.assembly.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from cpmemory._version import __version__
from cpmemory.engines.client import AsyncEngineClient, EngineSettings
from cpmemory.errors import EngineError, InvalidInputError, MissingDependencyError, PromptBudgetError
from cpmemory.hosted.transport import build_hosted_transport
from cpmemory.routing.dispatch import Dispatcher
from cpmemory.routing.prefix import EventPrefixView
from cpmemory.routing.router import Router
from cpmemory.routing.transport import ChatTransport, HttpxChatTransport
from cpmemory.server.assembly import (
    AUTO_TOKENIZER,
    adopt_engine_tokenizer,
    build_fit,
    build_fleet,
    build_hold,
    build_memory,
    build_salts,
    build_tokenizer,
    build_view,
    close_store,
    fleet_cache_tokens,
    size_fit,
)
from cpmemory.server.budget import EngineBudget, requested_answer_tokens
from cpmemory.server.config import ServerConfig
from cpmemory.server.fit import DEFAULT_TOKENS_PER_CHAR, FIT_HEADER
from cpmemory.server.hold import Admission, unheld
from cpmemory.server.metrics import ProxyMetrics
from cpmemory.server.operations import install_operations
from cpmemory.server.responses import (
    ERROR_RESPONSES,
    BodyLimit,
    TenantResolver,
    engine_error,
    error_response,
    install_error_handlers,
    unauthorized,
)
from cpmemory.server.schemas import ChatCompletionRequest
from cpmemory.server.service import (
    ProxyService,
    TurnInput,
    TurnMemory,
    engine_request_id,
    request_chars,
    turn_input,
)
from cpmemory.server.store_setup import build_store

try:  # the endpoint's annotations are read at runtime by FastAPI (extra ``server``; create_app checks it is there)
    from starlette.requests import Request
except ImportError:  # pragma: no cover - depends on the environment
    Request = Any  # type: ignore[misc,assignment]

__all__ = ["ServerConfig", "admit", "adopt_engine_tokenizer", "build_fit", "create_app", "fleet_cache_tokens"]

logger = logging.getLogger(__name__)


def create_app(
    config: ServerConfig, *, memory: TurnMemory | None = None, transport: ChatTransport | None = None
) -> Any:
    """Build the FastAPI app. No IO until it serves; the probe loop starts with the app's lifespan.

    Args:
        config: engines, store and tenants.
        memory: an ``AsyncCpMemory`` (default: built from the config).
        transport: how engine calls are made (default: httpx); tests pass one over an in-process engine.
    """
    try:
        from fastapi import FastAPI
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("server", "fastapi") from error
    targets = [config.upstream] if config.upstream else config.engines
    metrics = ProxyMetrics(len(targets))
    router = Router(targets, config.router, view=build_view(config))
    owns_transport, owns_memory = transport is None, memory is None
    transport = build_hosted_transport(config.hosted, metrics.registry, transport)  # cpmemory.hosted
    dispatcher = Dispatcher(router, transport or HttpxChatTransport(), timeout_s=config.engine_timeout_s,
                            failover=config.upstream is None, priority=config.engine_priority)
    store = build_store(config) if memory is None else None
    salts = build_salts(config, store)
    service = ProxyService(memory or build_memory(config, store), dispatcher, metrics, salts)
    service.upstream = config.upstream is not None
    service.salt_requests = config.cache_salt
    service.upstream_session = config.upstream_session
    if config.upstream is not None and config.cache_salt:
        logger.info("requests to %s carry per-tenant cache salts; a gateway that cannot hash them (vllm-router "
                    "kv_aware) routes them without its prefix score: a single-tenant proxy can run with "
                    "--upstream-kind vllm-router", config.upstream)
    if config.upstream is not None and len(config.engines) > 1 and not config.kv_events:
        logger.warning("behind %s without the replicas' --kv-events the proxy cannot tell which replica served a "
                       "turn: cache-fit admission counts the %d replicas as one pool and no eviction is followed "
                       "(most of the proxy's gain through a gateway needs them; docs/guides/serving.md)",
                       config.upstream, len(config.engines))
    service.fit = build_fit(config, metrics)
    service.gateway_replicas = len(config.engines) if config.attributes_gateway else 0
    service.fleet = build_fleet(config, service, router)
    service.hold = build_hold(config, service.memory, router, metrics,
                              cache_tokens=lambda: fleet_cache_tokens(config, service.fit),
                              fleet=service.fleet)
    tokenizer = build_tokenizer(config)
    metrics.local_tokenizer.set(1 if tokenizer is not None else 0)
    http_client = getattr(dispatcher.transport, "client", None)
    # /v1/models and /tokenize go to a replica itself, behind a gateway too when its replicas are given: a gateway
    # need not relay /tokenize, and a count routed through it would be one more request for it to route
    asked = None if http_client is None else AsyncEngineClient(
        EngineSettings(base_url=(config.engines or targets)[0], timeout_s=min(5.0, config.engine_timeout_s)),
        http=http_client)
    if config.prompt_budget and asked is not None:
        service.engine_budget = EngineBudget(asked, tokenizer)
        service.answer_reserve_tokens = config.answer_reserve_tokens
    find_tokenizer = config.tokenizer == AUTO_TOKENIZER and asked is not None and bool(
        config.prompt_budget or config.kv_events)

    lifespan = serving_tasks(config, service, tokenizer=tokenizer, asked=asked if find_tokenizer else None,
                             owns_transport=owns_transport, owns_memory=owns_memory)
    app = FastAPI(title="cpmemory proxy", version=__version__, lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)
    _install_routes(app, service, TenantResolver(config.api_keys))
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    return app


def serving_tasks(config: ServerConfig, service: ProxyService, *, tokenizer: Any, asked: AsyncEngineClient | None,
                  owns_transport: bool, owns_memory: bool) -> Callable[[Any], Any]:
    """The app's lifespan: while it serves, the replicas are probed, the caches sized (cache-fit admission), the
    engine's limits asked (the prompt budget), the KV events followed and, with ``asked``, the engine's tokenizer
    looked for; at the end every task stops and what the app made (``owns_*``) is closed."""
    dispatcher = service.dispatcher
    router = dispatcher.router

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        import cpmemory.core.index  # noqa: F401 - warm the index code now, not on the first request

        stop = asyncio.Event()
        probe = asyncio.create_task(dispatcher.probe_forever(stop))
        tasks: list[asyncio.Task[Any]] = []
        if service.fit is not None:
            tasks.append(asyncio.create_task(size_fit(service.fit, config)))
        if service.engine_budget is not None:  # the engine's limits asked now, not by the first burst's requests
            tasks.append(asyncio.create_task(service.engine_budget.warm()))
        if config.kv_events:
            from cpmemory.server.kv_sync import KVSyncHub

            event_view = router.view if isinstance(router.view, EventPrefixView) else None
            if config.attributes_gateway:  # attribution only: the gateway routes
                event_view = EventPrefixView(len(config.engines))
            service.kv_sync = KVSyncHub(service.memory, config.engines, config.kv_events, event_view, tokenizer)
            await service.kv_sync.start()
        if asked is not None:
            tasks.append(asyncio.create_task(adopt_engine_tokenizer(service, asked)))
        try:
            yield
        finally:
            stop.set()
            await probe
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if service.kv_sync is not None:
                await service.kv_sync.stop()
            # close only what the app made: a caller's transport or memory may outlive this app
            if owns_transport:
                await dispatcher.transport.aclose()
            if owns_memory:
                await close_store(service.memory)

    return lifespan


def _install_routes(app: Any, service: ProxyService, resolve_tenant: TenantResolver) -> None:
    from fastapi import Header
    from fastapi.responses import Response, StreamingResponse

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(
        request: ChatCompletionRequest,
        raw: Request,
        authorization: str | None = Header(default=None),
        x_cpmemory_conversation: str | None = Header(default=None, max_length=1024),
    ) -> Any:
        started = time.perf_counter()
        tenant = resolve_tenant(authorization)
        if tenant is None:
            return unauthorized()
        turn = None
        if request.cpmemory is not None or x_cpmemory_conversation is not None:
            try:
                turn = turn_input(request, x_cpmemory_conversation)
            except InvalidInputError as error:  # rejected before it is held: nothing waits for a bad request
                return error_response(400, "invalid_request_error", "invalid_input", str(error))
            too_long = await answer_tokens_error(service, request)
            if too_long is not None:
                return too_long
            service.arrived(tenant, turn)
        if service.needs_calibration:  # --hold-fit on a fresh proxy: count one request first
            await service.calibrate_estimate(request, turn)
        admission = await admit(service, raw, tenant, turn, held_tokens(service, request, turn))
        if admission is None:  # the client went away while held: nothing was prepared or sent
            return Response(status_code=499)
        response = None
        try:
            # hold time is its own histogram (cpmemory_hold_seconds), not middleware overhead
            response = await _respond(service, request, tenant, turn, started + admission.waited_s, admission)
            return response
        finally:
            if not isinstance(response, StreamingResponse):  # a stream gives the slot back when it is released
                admission.done()

    install_operations(app, service, resolve_tenant)




async def _respond(service: ProxyService, request: ChatCompletionRequest, tenant: str, turn: TurnInput | None,
                   started: float, admission: Admission) -> Any:
    """Serve an admitted request: pass it through, or prepare the turn (at release time, so the window planner's
    block orders apply) and run it."""
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    try:
        if turn is None:
            return await _plain(service, request, tenant, started, admission)
        prepared = await service.prepare(tenant, turn, request)
    except PromptBudgetError as error:
        return await budget_error(service, request, error)
    except InvalidInputError as error:
        return error_response(400, "invalid_request_error", "invalid_input", str(error))
    except EngineError as error:
        return engine_error(error)
    try:
        if request.stream:
            async with admission.sending():  # a released window reaches the engines in its planned order
                opened = replace(await service.open_turn_stream(request, tenant, turn, prepared, admission),
                                 admission=admission)
            headers = {"X-Cpmemory-Request-Id": engine_request_id(prepared),
                       "X-Cpmemory-Replica": str(opened.decision.index)}
            if opened.fit.admission is not None:  # cache-fit admission gated it: why it was let in, how long it waited
                headers[FIT_HEADER] = opened.fit.header()
            overhead = time.perf_counter() - started - opened.engine_seconds - opened.fit.waited_s
            # the background release is a safety net for a client gone before the body started (idempotent)
            return StreamingResponse(service.relay_stream(opened, prepared, overhead),
                                     media_type="text/event-stream", headers=headers,
                                     background=BackgroundTask(opened.release))
        async with admission.sending():  # the answer is the whole call: the next one goes as it starts
            pass
        outcome = await service.run_turn(request, tenant, turn, prepared, started, admission)
    except InvalidInputError as error:  # e.g. text that cannot be encoded; the turn was aborted
        return error_response(400, "invalid_request_error", "invalid_input", str(error))
    except EngineError as error:
        return engine_error(error)
    return JSONResponse(outcome.body)


async def answer_tokens_error(service: ProxyService, request: ChatCompletionRequest) -> Any:
    """A 400 naming the request's ``max_tokens`` (or ``max_completion_tokens``) when the answer it reserves is the
    model's whole context or more (no prompt could fit); None otherwise, or when the context is unknown. Asks the
    engine's limits (cached, cpmemory.server.budget)."""
    if service.engine_budget is None:
        return None
    answer = requested_answer_tokens(request, 0)
    if answer <= 0:
        return None
    limits = await service.engine_budget.limits(request.model)
    if limits.max_model_len is None or answer < limits.max_model_len:
        return None
    extra = request.model_extra or {}
    field = "max_completion_tokens" if extra.get("max_completion_tokens") == answer else "max_tokens"
    return error_response(
        400, "invalid_request_error", "invalid_input",
        f"{field} is {answer} but the model's context is {limits.max_model_len} tokens: the answer alone would fill "
        f"it, leaving no room for the prompt; ask for fewer than {limits.max_model_len} tokens", param=field)


async def budget_error(service: ProxyService, request: ChatCompletionRequest, error: PromptBudgetError) -> Any:
    """The 400 of a turn whose prompt cannot fit: when the request reserves answer tokens, the message says the
    budget is the context less them and ``param`` names the field (the cut a client can make); else as raised."""
    extra = request.model_extra or {}
    field = next((name for name in ("max_completion_tokens", "max_tokens") if isinstance(extra.get(name), int)), None)
    limits = await service.engine_budget.limits(request.model) if service.engine_budget is not None else None
    if field is None or limits is None or limits.max_model_len is None:
        return error_response(400, "invalid_request_error", "invalid_input", str(error))
    message = (f"{error}: the prompt's budget is the model's context ({limits.max_model_len} tokens) less {field} "
               f"({extra[field]}); ask for fewer answer tokens, or send fewer or shorter blocks")
    return error_response(400, "invalid_request_error", "invalid_input", message, param=field)


def held_tokens(service: ProxyService, request: ChatCompletionRequest, turn: TurnInput | None) -> int:
    """A request's prompt tokens as the hold queue's token bound counts them, before it is prepared: the characters
    of its messages and blocks at the tokens per character that cache-fit admission learnt (``calibrate_estimate``;
    else about four characters a token). 0 when the queue has no token bound."""
    if service.hold is None or not service.hold.counts_tokens:
        return 0
    chars = request_chars(request, turn)
    return service.fit.estimate(chars, 0) if service.fit is not None else int(chars * DEFAULT_TOKENS_PER_CHAR)


async def admit(service: ProxyService, raw: Any, tenant: str, turn: TurnInput | None,
                tokens: int = 0) -> Admission | None:
    """The request's admission by the hold queue (at once when it is off or within its bounds); None when the
    client disconnected while held (the request left the queue). ``tokens``: its estimated prompt tokens."""
    hold = service.hold
    if hold is None:
        return unheld()
    admission = hold.try_admit(tokens)
    if admission is not None:
        return admission
    waiter = asyncio.ensure_future(hold.admit(tenant, turn.blocks if turn is not None else (), tokens))
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled: leave the queue (or give back a slot just granted)
        _abandon(waiter)
        raise
    finally:
        gone.cancel()
    if waiter.done():
        return waiter.result()  # released (even if the client left at the same moment: the turn runs, no loss)
    _abandon(waiter)
    return None


def _abandon(waiter: asyncio.Future[Admission]) -> None:
    if not waiter.done():
        waiter.cancel()  # HoldQueue.admit removes the entry, or gives back the slot of a release it did not see
    elif not waiter.cancelled() and waiter.exception() is None:
        waiter.result().done()


async def _disconnected(raw: Any) -> None:
    """Return when the client disconnects (the body was read: the next ASGI message is the disconnect)."""
    while True:
        message = await raw.receive()
        if message.get("type") == "http.disconnect":
            return


async def _plain(service: ProxyService, request: ChatCompletionRequest, tenant: str, started: float,
                 admission: Admission) -> Any:
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    if request.stream:
        async with admission.sending():
            opened = replace(await service.open_pass_through_stream(request, tenant), admission=admission)
        overhead = time.perf_counter() - started - opened.engine_seconds
        return StreamingResponse(service.relay_stream(opened, None, overhead), media_type="text/event-stream",
                                 background=BackgroundTask(opened.release))
    async with admission.sending():
        pass
    result = await service.pass_through(request, tenant)
    service.metrics.overhead.observe(max(0.0, time.perf_counter() - started - result.engine_seconds))
    return JSONResponse(result.response)

