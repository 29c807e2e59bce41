"""The proxy's operational endpoints: eviction reports, health, metrics, and the engines' read-only OpenAI endpoints.

* ``POST /v1/cpmemory/evictions`` - request ids an engine evicted; their index leaves are removed (caller's tenant).
* ``GET /livez`` - liveness: 200 while the process serves requests (no engine or store is asked).
* ``GET /readyz`` - readiness: 200 when at least one engine answers its health check now and the session store
  serves a read; 503 otherwise (the body says which).
* ``GET /healthz`` - the router's view of the replicas (marked down after a failure, back after a probe): 200 while
  one is in rotation, 503 when none is.
* ``GET /metrics`` - Prometheus.
* ``GET /v1/models``, ``GET /v1/models/{model}`` - relayed from the first engine (or the gateway) that answers, with
  the caller's API key checked as for chat calls: clients and UIs that list models first work through the proxy.
"""
from __future__ import annotations

import asyncio
from typing import Any

from cpmemory.routing.prefix import EventPrefixView
from cpmemory.server.responses import ERROR_RESPONSES, TenantResolver, error_response, unauthorized
from cpmemory.server.schemas import EvictionReport, EvictionResult, HealthOut, ReadyOut, ReplicaHealth
from cpmemory.server.service import ProxyService
from cpmemory.server.store_setup import store_ready

try:  # the endpoints' annotations are read at runtime by FastAPI (extra ``server``; create_app checks it is there)
    from starlette.requests import Request
except ImportError:  # pragma: no cover - depends on the environment
    Request = Any  # type: ignore[misc,assignment]

READ_ONLY_PATHS = ("/v1/models", "/v1/models/{model:path}")
"""The engines' read-only OpenAI endpoints relayed as they answer them."""
RELAY_TIMEOUT_S = 10.0


def install_operations(app: Any, service: ProxyService, resolve_tenant: TenantResolver) -> None:
    """Add the endpoints of the module docstring to ``app``."""
    from fastapi import Header
    from fastapi.responses import JSONResponse, Response

    @app.post("/v1/cpmemory/evictions", response_model=EvictionResult, responses=ERROR_RESPONSES)
    async def evictions(report: EvictionReport, authorization: str | None = Header(default=None)) -> Any:
        tenant = resolve_tenant(authorization)
        if tenant is None:
            return unauthorized()
        removed = await service.memory.evict(list(report.request_ids), tenant=tenant)
        service.metrics.evictions.inc(removed)
        if service.kv_sync is not None:
            service.kv_sync.forget(report.request_ids)
        return EvictionResult(evicted=removed)

    @app.get("/livez")
    async def livez() -> Any:
        return {"status": "ok"}

    @app.get("/readyz", response_model=ReadyOut, responses={503: {"model": ReadyOut}})
    async def readyz() -> Any:
        body = await readiness(service)
        return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)

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
        observe_metrics(service)
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    async def relayed(raw: Request, authorization: str | None = Header(default=None)) -> Any:
        if resolve_tenant(authorization) is None:
            return unauthorized()
        return await relay_read(service, raw.url.path)

    for path in READ_ONLY_PATHS:
        app.add_api_route(path, relayed, methods=["GET"], responses=ERROR_RESPONSES, include_in_schema=False)


async def readiness(service: ProxyService) -> ReadyOut:
    """Ask every engine's health check (at once) and the store for a read; never raises."""
    urls = service.dispatcher.router.urls
    answers = await asyncio.gather(*(service.dispatcher.transport.is_healthy(url) for url in urls),
                                   return_exceptions=True)
    reachable = sum(1 for answer in answers if answer is True)
    store = getattr(service.memory, "store", None)
    store_ok, why = (True, "in process memory") if store is None else await store_ready(store)
    return ReadyOut(ready=reachable > 0 and store_ok, engines_reachable=reachable, engines=len(urls),
                    store="ok" if store_ok else f"unavailable: {why}")


def observe_metrics(service: ProxyService) -> None:
    """Copy the gauges kept elsewhere (the facade's counters, KV sync, the hold queue, the event view) into the
    metrics before they are rendered. Mutates ``service.metrics``."""
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


async def relay_read(service: ProxyService, path: str) -> Any:
    """GET ``path`` from the replicas in rotation first, then the others, and relay the first answer (any status);
    502 when none answers."""
    from fastapi.responses import JSONResponse, Response

    http = getattr(service.dispatcher.transport, "client", None)
    if http is None:
        return error_response(501, "engine_error", "not_relayed", f"this proxy's engine transport cannot relay {path}")
    router = service.dispatcher.router
    healthy = set(router.healthy_indices())
    order = sorted(range(len(router.urls)), key=lambda index: index not in healthy)
    failures = []
    for index in order:
        url = router.urls[index].rstrip("/") + path
        try:
            answer = await http.get(url, timeout=RELAY_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any transport failure: try the next replica
            failures.append(type(error).__name__)
            continue
        if answer.headers.get("content-type", "").startswith("application/json"):
            try:
                return JSONResponse(answer.json(), status_code=answer.status_code)
            except ValueError:
                pass  # relayed as bytes below
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"))
    return error_response(502, "engine_error", "engine_failed",
                          f"no engine answered GET {path} ({', '.join(failures) or 'no engine'})")
