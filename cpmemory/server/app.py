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
import time
from collections.abc import AsyncIterator
from typing import Any

from cpmemory._version import __version__
from cpmemory.engines.client import AsyncEngineClient, EngineSettings
from cpmemory.errors import (
    EngineError,
    EngineStatusError,
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
from cpmemory.server.metrics import ProxyMetrics
from cpmemory.server.salt import CacheSalts
from cpmemory.server.schemas import (
    ChatCompletionRequest,
    ErrorBody,
    EvictionReport,
    EvictionResult,
    HealthOut,
    ReplicaHealth,
)
from cpmemory.server.service import ProxyService, TurnMemory, engine_request_id, turn_input
from cpmemory.stores.base import AsyncSessionStore

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
                            failover=config.upstream is None)
    store = build_store(config) if memory is None else None
    salts = build_salts(config, store)
    service = ProxyService(memory or build_memory(config, store), dispatcher, metrics, salts)
    service.upstream = config.upstream is not None
    http_client = getattr(dispatcher.transport, "client", None)
    if config.prompt_budget and http_client is not None:
        settings = EngineSettings(base_url=targets[0], timeout_s=min(5.0, config.engine_timeout_s))
        service.engine_budget = EngineBudget(AsyncEngineClient(settings, http=http_client))
        service.answer_reserve_tokens = config.answer_reserve_tokens

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        import cpmemory.core.index  # noqa: F401 - warm the index code now, not on the first request

        stop = asyncio.Event()
        probe = asyncio.create_task(dispatcher.probe_forever(stop))
        if config.kv_events:
            from cpmemory.server.kv_sync import KVSyncHub

            event_view = router.view if isinstance(router.view, EventPrefixView) else None
            service.kv_sync = KVSyncHub(service.memory, config.engines, config.kv_events, event_view)
            await service.kv_sync.start()
        try:
            yield
        finally:
            stop.set()
            await probe
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


def build_view(config: ServerConfig) -> PrefixView | None:
    """The router's view of the replicas' caches: their KV events when given, else what was sent where.

    None behind a gateway (it routes) or with the ``affinity`` policy.
    """
    if config.upstream is not None or config.router.policy == "affinity":
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
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(
        request: ChatCompletionRequest,
        authorization: str | None = Header(default=None),
        x_cpmemory_conversation: str | None = Header(default=None, max_length=1024),
    ) -> Any:
        started = time.perf_counter()
        tenant = resolve_tenant(authorization)
        if tenant is None:
            return _unauthorized()
        try:
            if request.cpmemory is None and x_cpmemory_conversation is None:
                return await _plain(service, request, tenant, started)
            turn = turn_input(request, x_cpmemory_conversation)
            prepared = await service.prepare(tenant, turn, request)
        except InvalidInputError as error:
            return error_response(400, "invalid_request_error", "invalid_input", str(error))
        except EngineError as error:
            return _engine_error(error)
        try:
            if request.stream:
                opened = await service.open_turn_stream(request, tenant, turn, prepared)
                headers = {"X-Cpmemory-Request-Id": engine_request_id(prepared),
                           "X-Cpmemory-Replica": str(opened.decision.index)}
                overhead = time.perf_counter() - started - opened.engine_seconds
                # the background release is a safety net for a client gone before the body started (idempotent)
                return StreamingResponse(service.relay_stream(opened, prepared, overhead),
                                         media_type="text/event-stream", headers=headers,
                                         background=BackgroundTask(opened.release))
            outcome = await service.run_turn(request, tenant, turn, prepared, started)
        except InvalidInputError as error:  # e.g. text that cannot be encoded; the turn was aborted
            return error_response(400, "invalid_request_error", "invalid_input", str(error))
        except EngineError as error:
            return _engine_error(error)
        return JSONResponse(outcome.body)

    _install_operations(app, service, resolve_tenant)


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
        if service.kv_sync is not None:
            service.metrics.observe_kv_sync(service.kv_sync.stats(), service.kv_sync.failures)
        view = service.dispatcher.router.view
        if isinstance(view, EventPrefixView):
            service.metrics.observe_prefix_view(view, len(service.dispatcher.router.urls))
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)


async def _plain(service: ProxyService, request: ChatCompletionRequest, tenant: str, started: float) -> Any:
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    if request.stream:
        opened = await service.open_pass_through_stream(request, tenant)
        overhead = time.perf_counter() - started - opened.engine_seconds
        return StreamingResponse(service.relay_stream(opened, None, overhead), media_type="text/event-stream",
                                 background=BackgroundTask(opened.release))
    result = await service.pass_through(request, tenant)
    service.metrics.overhead.observe(max(0.0, time.perf_counter() - started - result.engine_seconds))
    return JSONResponse(result.response)
