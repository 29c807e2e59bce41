"""The OpenAI-compatible proxy (FastAPI app factory). Needs the ``server`` extra.

Endpoints:
  * ``POST /v1/chat/completions`` - OpenAI chat completions, streaming or not. With the ``cpmemory`` extension field
    (or the ``X-Cpmemory-Conversation`` header) the call becomes a cpmemory turn (dedup, reorder, annotate, commit);
    without it the request passes through to a replica chosen by prefix affinity.
  * ``POST /v1/cpmemory/evictions`` - request ids an engine evicted; their index leaves are removed (caller's tenant).
  * ``GET /metrics`` (Prometheus), ``GET /healthz``.

Errors produced by the proxy itself always have the body ``{"error": {"type", "code", "message", "details"?}}``:
400 bad input, 401 unknown API key, 422 malformed JSON / schema, 502 engine failure, 503 no healthy replica.
A rejected request changes no stored state.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from cpmemory._version import __version__
from cpmemory.core.blocks import Block
from cpmemory.core.scheduling import ReleasePlan
from cpmemory.engines.client import AsyncEngineClient, EngineSettings
from cpmemory.errors import (
    CpMemoryError,
    EngineError,
    EngineStatusError,
    EngineUnreachableError,
    InvalidInputError,
    MissingDependencyError,
    NoHealthyReplicaError,
)
from cpmemory.routing.dispatch import Dispatcher
from cpmemory.routing.prefix import EventPrefixView, PrefixView, SentPrefixView
from cpmemory.routing.router import Router
from cpmemory.routing.transport import ChatTransport, HttpxChatTransport
from cpmemory.server.budget import EngineBudget
from cpmemory.server.config import ServerConfig
from cpmemory.server.fit import DEFAULT_TOKENS_PER_CHAR, FIT_HEADER, CacheFit
from cpmemory.server.hold import Admission, HoldQueue, unheld
from cpmemory.server.metrics import ProxyMetrics
from cpmemory.server.pick import SentOrders
from cpmemory.server.salt import CacheSalts
from cpmemory.server.schemas import (
    ChatCompletionRequest,
    ErrorBody,
    EvictionReport,
    EvictionResult,
    HealthOut,
    ReplicaHealth,
)
from cpmemory.server.service import (
    ProxyService,
    TurnInput,
    TurnMemory,
    engine_request_id,
    request_chars,
    turn_input,
)
from cpmemory.stores.base import AsyncSessionStore

try:  # the endpoint's annotations are read at runtime by FastAPI (extra ``server``; create_app checks it is there)
    from starlette.requests import Request
except ImportError:  # pragma: no cover - depends on the environment
    Request = Any  # type: ignore[misc,assignment]

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"


def error_response(status: int, error_type: str, code: str, message: str, details: Any = None) -> Any:
    """A JSONResponse with the proxy's typed error body."""
    from fastapi.responses import JSONResponse

    body = ErrorBody.model_validate({"error": {"type": error_type, "code": code, "message": message,
                                               "details": details}})
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status)


def _safe_details(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # pydantic error dicts may hold the offending input or exception objects: keep only printable fields.
    return [{"loc": [str(part) for part in error.get("loc", ())], "msg": str(error.get("msg", "")),
             "type": str(error.get("type", ""))} for error in errors[:20]]


def build_store(config: ServerConfig) -> AsyncSessionStore:
    """The session store the config asks for: Redis (``redis_url`` with ``config.redis``), else in process memory."""
    if config.redis_url is None:
        from cpmemory.stores.memory import AsyncInMemorySessionStore

        return AsyncInMemorySessionStore(ttl_s=config.memory.ttl_s)
    from cpmemory.stores.redis_store import AsyncRedisSessionStore

    return AsyncRedisSessionStore.from_url(config.redis_url, config.redis)


def build_memory(config: ServerConfig, store: AsyncSessionStore | None = None) -> TurnMemory:
    """Create the facade the config asks for (``config.memory`` over ``store`` or the configured store)."""
    from cpmemory.facade import AsyncCpMemory

    return AsyncCpMemory(store=store if store is not None else build_store(config), config=config.memory)


def build_salts(config: ServerConfig, store: AsyncSessionStore | None) -> CacheSalts:
    """The tenants' cache salts: the configured secret, else one kept in the Redis store, else per process."""
    if config.cache_salt_secret is not None:
        return CacheSalts(config.cache_salt_secret.get_secret_value())
    client = getattr(store, "client", None) if config.redis_url is not None else None
    return CacheSalts(None, redis_client=client, redis_prefix=config.redis.prefix)


class _TenantResolver:
    """API key -> tenant. Keys are kept only as SHA-256 digests."""

    def __init__(self, api_keys: dict[str, str]) -> None:
        self._tenants = {hashlib.sha256(key.encode()).hexdigest(): tenant for key, tenant in api_keys.items()}

    def __call__(self, authorization: str | None) -> str | None:
        if not self._tenants:
            return DEFAULT_TENANT
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        token = authorization[7:].strip()
        return self._tenants.get(hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest())


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
                    "--no-cache-salt", config.upstream)
    if config.upstream is not None and len(config.engines) > 1 and not config.kv_events:
        logger.warning("behind %s without the replicas' --kv-events the proxy cannot tell which replica served a "
                       "turn: cache-fit admission counts the %d replicas as one pool and no eviction is followed "
                       "(MT-RAG through vllm-router: 1.14x and 1.36x the original's TTFT, 1.78-2.46x with them; "
                       "docs/server.md)", config.upstream, len(config.engines))
    service.fit = build_fit(config, metrics)
    service.gateway_replicas = len(config.engines) if config.attributes_gateway else 0
    service.sent_orders = build_sent_orders(config, service)
    service.hold = build_hold(config, service.memory, router, metrics,
                              cache_tokens=lambda: fleet_cache_tokens(config, service.fit),
                              sent_orders=service.sent_orders)
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

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        import cpmemory.core.index  # noqa: F401 - warm the index code now, not on the first request

        stop = asyncio.Event()
        probe = asyncio.create_task(dispatcher.probe_forever(stop))
        sizing = asyncio.create_task(size_fit(service.fit, config)) if service.fit is not None else None
        # the engine's limits asked now, not by the first burst's requests (EngineBudget.warm)
        warming = asyncio.create_task(service.engine_budget.warm()) if service.engine_budget is not None else None
        if config.kv_events:
            from cpmemory.server.kv_sync import KVSyncHub

            event_view = router.view if isinstance(router.view, EventPrefixView) else None
            if config.attributes_gateway:  # attribution only: the gateway routes
                event_view = EventPrefixView(len(config.engines))
            service.kv_sync = KVSyncHub(service.memory, config.engines, config.kv_events, event_view, tokenizer)
            await service.kv_sync.start()
        finder = asyncio.create_task(adopt_engine_tokenizer(service, asked)) if find_tokenizer else None
        try:
            yield
        finally:
            stop.set()
            await probe
            if finder is not None:
                finder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await finder
            if warming is not None:
                warming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await warming
            if sizing is not None:
                sizing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sizing
            if service.kv_sync is not None:
                await service.kv_sync.stop()
            # close only what the app made: a caller's transport or memory may outlive this app
            if owns_transport:
                await dispatcher.transport.aclose()
            if owns_memory:
                await _close_store(service.memory)

    app = FastAPI(title="cpmemory proxy", version=__version__, lifespan=lifespan)
    app.state.service = service
    _install_error_handlers(app)
    _install_routes(app, service, _TenantResolver(config.api_keys))
    return app


def build_hold(config: ServerConfig, memory: TurnMemory, router: Router, metrics: ProxyMetrics,
               cache_tokens: Callable[[], int | None] | None = None,
               sent_orders: SentOrders | None = None) -> HoldQueue | None:
    """The hold-and-release queue when ``max_in_flight`` or ``hold_fit`` is set (with ``hold_fit`` the requests in
    flight may take at most ``cache_tokens()`` estimated prompt tokens together; no token bound while that is
    unknown): the facade's ``release_plan`` plans each window
    (``release_order`` with ``hold_split`` off, behind a gateway unless each lane can be named to it as a session,
    or where a memory has no ``release_plan``; neither: first come first served), told ``cache_tokens()`` (what the
    fleet's KV caches hold, when known: a window that outgrows it is planned as a batch and split over the healthy
    replicas, or the gateway's); the bound scales with the healthy replicas. With ``sent_orders`` (``hold_pick``)
    a replica with room picks one held request at a time by that view."""
    if config.max_in_flight is None and not config.hold_fit:
        return None
    # behind a gateway a lane can only be named as a session (its replicas known from their KV events); reordering
    # alone, with the gateway placing each request, measured worse (docs/server.md)
    gateway_lanes = len(config.engines) if config.upstream_session and config.attributes_gateway else 0
    split = config.hold_split and (config.upstream is None or gateway_lanes > 1)
    release_plan = getattr(memory, "release_plan", None) if split else None
    release_order = getattr(memory, "release_order", None)
    planner = None
    if release_plan is not None or release_order is not None:
        def planner(requests: Sequence[Sequence[Block]], tenant: str) -> Sequence[int] | ReleasePlan:
            size = None if cache_tokens is None else cache_tokens()
            if release_plan is not None:
                lanes = gateway_lanes or max(1, router.healthy_count())
                return release_plan(requests, tenant=tenant, cache_tokens=size, lanes=lanes)  # type: ignore[no-any-return]
            assert release_order is not None
            if size is None:
                return release_order(requests, tenant=tenant)  # type: ignore[no-any-return]
            return release_order(requests, tenant=tenant, cache_tokens=size)  # type: ignore[no-any-return]
    pick = None if sent_orders is None or planner is None else sent_orders.cached
    return HoldQueue(config.max_in_flight, config.hold_ms / 1000.0, replicas=router.healthy_count,
                     token_budget=cache_tokens if config.hold_fit else None, planner=planner, observer=metrics,
                     pick=pick, healthy=router.healthy_indices)


def build_sent_orders(config: ServerConfig, service: ProxyService) -> SentOrders | None:
    """The view of the block orders sent to each replica that ``hold_pick`` picks by, bounded by each replica's KV
    cache in characters (cache-fit admission's sizes and tokens per character; unbounded while unknown)."""
    if not config.hold_pick:
        return None

    def capacity(replica: int) -> float | None:
        fit = service.fit
        tokens = fit.capacities[replica] if fit is not None and 0 <= replica < len(fit.capacities) else None
        return None if fit is None or tokens is None else tokens / max(fit.tokens_per_char, 1e-6)

    return SentOrders(capacity)


def fleet_cache_tokens(config: ServerConfig, fit: CacheFit | None) -> int | None:
    """The KV cache of every replica together (a held window spreads over them): the sizes cache-fit admission
    read from the engines when all are known, else ``replica_cache_tokens`` when given, else None (unknown)."""
    if fit is not None and fit.capacities and all(size is not None for size in fit.capacities):
        return sum(size for size in fit.capacities if size is not None)
    if "replica_cache_tokens" in config.model_fields_set:
        return config.replica_cache_tokens * max(1, len(config.engines))
    return None


def build_fit(config: ServerConfig, metrics: ProxyMetrics) -> CacheFit | None:
    """Cache-fit admission (cpmemory.server.fit) when on: one pool per replica (one for the fleet behind a
    gateway, unless its replicas' KV events tell which replica served each turn), sized by ``replica_cache_tokens`` when it is given; :func:`size_fit` reads the engines' sizes."""
    if not config.fit:
        return None
    given = config.replica_cache_tokens if "replica_cache_tokens" in config.model_fields_set else None
    if config.attributes_gateway:  # one pool per replica behind the gateway: its KV events say which served a turn
        pools, size = len(config.engines), given
    elif config.upstream is not None:  # the fleet's cache: every replica behind the gateway (one if none is named)
        pools, size = 1, None if given is None else given * max(1, len(config.engines))
    else:
        pools, size = len(config.engines), given
    return CacheFit([size] * pools, fill=config.fit_fill, idle_s=config.fit_idle_ms / 1000.0,
                    first_idle_s=config.fit_first_idle_ms / 1000.0, grace_s=config.fit_grace_ms / 1000.0,
                    max_wait_s=config.fit_max_wait_s, observer=metrics, learn_idle=config.fit_learn_idle,
                    move=config.fit_move)


async def size_fit(fit: CacheFit, config: ServerConfig) -> None:
    """Read each engine's KV cache size (``/metrics`` ``vllm:cache_config_info``) into ``fit``; an engine that
    does not report it keeps the configured size (or none: that pool admits everything). Never raises."""
    import httpx

    sizes: list[int | None] = []
    async with httpx.AsyncClient() as http:
        for url in config.engines:
            client = AsyncEngineClient(EngineSettings(base_url=url, timeout_s=5.0), http=http)
            try:
                cache = await client.cache_config()
            except (CpMemoryError, OSError, httpx.HTTPError) as error:
                logger.info("cache-fit admission: no KV cache size from %s (%s)", url, error)
                sizes.append(None)
                continue
            sizes.append(cache.num_blocks * cache.block_size if cache.num_blocks else None)
    if config.upstream is not None and not config.attributes_gateway:
        if sizes and all(size is not None for size in sizes):
            fit.set_capacity(0, sum(size for size in sizes if size is not None))
        return
    for replica, size in enumerate(sizes):
        if size is not None:
            fit.set_capacity(replica, size)


AUTO_TOKENIZER = "auto"
TOKENIZER_RETRY_S = 10.0
TOKENIZER_TRIES = 60


async def adopt_engine_tokenizer(service: ProxyService, client: Any, *, retry_s: float = TOKENIZER_RETRY_S,
                                 tries: int = TOKENIZER_TRIES) -> bool:
    """``--tokenizer auto``: find the engine's own tokenizer (``local_tokenizer.discover``) and use it for prompt
    counts and KV-event hashing instead of ``/tokenize`` round trips. Retries
    while the engine does not answer (it may start after the proxy); gives up at once on a tokenizer that does not
    load here or tokenizes differently. Returns whether it adopted one."""
    from cpmemory.engines.local_tokenizer import discover

    for attempt in range(tries):
        try:
            local, why = await discover(client)
        except EngineUnreachableError as error:
            logger.debug("engine tokenizer: %s (attempt %d)", error, attempt + 1)
            await asyncio.sleep(retry_s)
            continue
        except EngineError as error:  # it answered, with an error: /v1/models or /tokenize is not served
            local, why = None, str(error)
        if local is None:
            logger.info("prompts are counted by the engine's /tokenize: %s", why)
            return False
        if service.engine_budget is not None:
            service.engine_budget.use_tokenizer(local)
        if service.kv_sync is not None:
            service.kv_sync.tokenizer = local
        service.metrics.local_tokenizer.set(1)
        logger.info("prompts are tokenized in the proxy: %s", why)
        return True
    return False


def build_tokenizer(config: ServerConfig) -> Any:
    """The served model's tokenizer when ``config.tokenizer`` names one (loaded now: a bad path fails the start
    with InvalidInputError), else None (the replicas' ``/tokenize`` is asked; ``"auto"``: until the engine's own is
    found, :func:`adopt_engine_tokenizer`)."""
    if config.tokenizer is None or config.tokenizer == AUTO_TOKENIZER:
        return None
    from cpmemory.engines.local_tokenizer import LocalTokenizer

    return LocalTokenizer(config.tokenizer)


def build_view(config: ServerConfig) -> PrefixView | None:
    """The router's view of the replicas' caches: their KV events when given, else what was sent where.

    None behind a gateway (it routes) or with the ``affinity`` or ``session`` policy (keys and load decide).
    """
    if config.upstream is not None or config.router.policy in ("affinity", "session"):
        return None
    if config.kv_events:
        return EventPrefixView(len(config.engines))
    return SentPrefixView(len(config.engines), config.replica_cache_tokens)


async def _close_store(memory: Any) -> None:
    store = getattr(memory, "store", None)
    closer = getattr(store, "close", None) or getattr(store, "aclose", None)
    if closer is None:
        return
    with contextlib.suppress(Exception):
        result = closer()
        if asyncio.iscoroutine(result):
            await result


def _install_error_handlers(app: Any) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Any, error: RequestValidationError) -> Any:
        return error_response(422, "invalid_request_error", "validation_error", "the request does not match the "
                              "schema", _safe_details(list(error.errors())))

    @app.exception_handler(HTTPException)
    async def _http(_: Any, error: HTTPException) -> Any:
        return error_response(error.status_code, "invalid_request_error", f"http_{error.status_code}",
                              str(error.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Any, error: Exception) -> Any:  # pragma: no cover - a bug; still a typed body
        return error_response(500, "internal_error", "internal_error", type(error).__name__)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 422, 502, 503)
}


def _engine_error(error: EngineError) -> Any:
    if isinstance(error, NoHealthyReplicaError):
        return error_response(503, "engine_error", "no_healthy_replica", str(error))
    if isinstance(error, EngineStatusError) and 400 <= error.status_code < 500:
        return _relay_engine_client_error(error)
    return error_response(502, "engine_error", "engine_failed", str(error))


def _relay_engine_client_error(error: EngineStatusError) -> Any:
    from fastapi.responses import JSONResponse

    try:
        body = json.loads(error.body)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return JSONResponse(body, status_code=error.status_code)
    text = error.body if isinstance(error.body, str) else error.body.decode("utf-8", "replace")
    return error_response(error.status_code, "engine_error", "engine_rejected", text[:500])


def _install_routes(app: Any, service: ProxyService, resolve_tenant: _TenantResolver) -> None:
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
            return _unauthorized()
        turn = None
        if request.cpmemory is not None or x_cpmemory_conversation is not None:
            try:
                turn = turn_input(request, x_cpmemory_conversation)
            except InvalidInputError as error:  # rejected before it is held: nothing waits for a bad request
                return error_response(400, "invalid_request_error", "invalid_input", str(error))
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

    _install_operations(app, service, resolve_tenant)


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
    except InvalidInputError as error:
        return error_response(400, "invalid_request_error", "invalid_input", str(error))
    except EngineError as error:
        return _engine_error(error)
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
        return _engine_error(error)
    return JSONResponse(outcome.body)


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


def _unauthorized() -> Any:
    return error_response(401, "authentication_error", "invalid_api_key", "unknown or missing API key")


def _install_operations(app: Any, service: ProxyService, resolve_tenant: _TenantResolver) -> None:
    """Eviction reports, health and metrics."""
    from fastapi import Header
    from fastapi.responses import JSONResponse, Response

    @app.post("/v1/cpmemory/evictions", response_model=EvictionResult, responses=ERROR_RESPONSES)
    async def evictions(report: EvictionReport, authorization: str | None = Header(default=None)) -> Any:
        tenant = resolve_tenant(authorization)
        if tenant is None:
            return _unauthorized()
        removed = await service.memory.evict(list(report.request_ids), tenant=tenant)
        service.metrics.evictions.inc(removed)
        if service.kv_sync is not None:
            service.kv_sync.forget(report.request_ids)
        return EvictionResult(evicted=removed)

    @app.get("/healthz", response_model=HealthOut, responses={503: {"model": HealthOut}})
    async def healthz() -> Any:
        replicas = [ReplicaHealth(index=s.index, healthy=s.healthy, in_flight=s.in_flight)
                    for s in service.dispatcher.router.status()]
        healthy = sum(1 for replica in replicas if replica.healthy)
        status = "ok" if healthy == len(replicas) else ("degraded" if healthy else "down")
        body = HealthOut(status=status, replicas=replicas).model_dump()
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        counters = getattr(service.memory, "counters", None)
        if counters is not None:
            service.metrics.observe_memory(counters.snapshot())
        if service.kv_sync is not None:
            service.metrics.observe_kv_sync(service.kv_sync.stats(), service.kv_sync.failures)
        if service.hold is not None:
            service.metrics.hold_admitted.set(service.hold.admitted)
            service.metrics.hold_tokens.set(service.hold.tokens)
            service.metrics.hold_waiting.set(service.hold.waiting)
        view = service.dispatcher.router.view
        if isinstance(view, EventPrefixView):
            service.metrics.observe_prefix_view(view, len(service.dispatcher.router.urls))
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)


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
