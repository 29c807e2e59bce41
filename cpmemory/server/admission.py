"""How the proxy's admission is assembled from its configuration: the hold queue (``hold.policy``), the view the
pick scores with, and cache-fit admission with its cache sizes. Every ``build_*`` is free of IO; :func:`size_fit`
runs as a task of the app's lifespan.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from cpmemory.core.blocks import Block
from cpmemory.core.scheduling import ReleasePlan
from cpmemory.engines.client import AsyncEngineClient, EngineSettings
from cpmemory.errors import CpMemoryError
from cpmemory.routing.fleet import FleetView
from cpmemory.routing.router import Router
from cpmemory.server.config import ServerConfig
from cpmemory.server.fit import CacheFit, FitSettings
from cpmemory.server.hold import HoldQueue, Planner
from cpmemory.server.metrics import ProxyMetrics
from cpmemory.server.pick import PickRelease
from cpmemory.server.service import ProxyService, TurnMemory

logger = logging.getLogger(__name__)


def build_planner(config: ServerConfig, memory: TurnMemory, router: Router,
                  cache_tokens: Callable[[], int | None] | None) -> Planner | None:
    """The hold's planner: the facade's ``release_plan`` (told ``cache_tokens()``, what the fleet's KV caches hold
    when known: a window that outgrows it is planned as a batch and split over the healthy replicas, or the
    gateway's), or ``release_order`` without the split (``experimental.hold_split`` off, behind a gateway unless
    each lane can be named to it as a session, or where a memory has no ``release_plan``); None where the memory
    has neither (first come first served)."""
    # behind a gateway a lane can only be named as a session (its replicas known from their KV events); reordering
    # alone, with the gateway placing each request, measured worse (docs/decisions.md)
    gateway_lanes = len(config.engines) if config.upstream_session and config.attributes_gateway else 0
    split = config.experimental.hold_split and (config.upstream is None or gateway_lanes > 1)
    release_plan = getattr(memory, "release_plan", None) if split else None
    release_order = getattr(memory, "release_order", None)
    if release_plan is None and release_order is None:
        return None

    def planner(requests: Sequence[Sequence[Block]], tenant: str) -> Sequence[int] | ReleasePlan:
        size = None if cache_tokens is None else cache_tokens()
        if release_plan is not None:
            lanes = gateway_lanes or max(1, router.healthy_count())
            return release_plan(requests, tenant=tenant, cache_tokens=size, lanes=lanes)  # type: ignore[no-any-return]
        assert release_order is not None
        if size is None:
            return release_order(requests, tenant=tenant)  # type: ignore[no-any-return]
        return release_order(requests, tenant=tenant, cache_tokens=size)  # type: ignore[no-any-return]

    return planner


def build_hold(config: ServerConfig, memory: TurnMemory, router: Router, metrics: ProxyMetrics,
               cache_tokens: Callable[[], int | None] | None = None,
               fleet: FleetView | None = None) -> HoldQueue | None:
    """The hold queue of ``config.hold`` (None when its policy is ``off``): its bounds are the policy's
    (``HoldConfig.settings``), the count bound scaling with the healthy replicas and the token bound reading
    ``cache_tokens()``; ``pick`` picks by the block orders ``fleet`` follows (:func:`build_fleet`) and counts
    what it released in the fleet's records."""
    settings = config.hold.settings()
    if settings is None:
        return None
    planner = build_planner(config, memory, router, cache_tokens)
    policy = None if fleet is None or not fleet.follow_orders or planner is None \
        else PickRelease(fleet.cached_order, router.healthy_indices, fleet)
    return HoldQueue(settings.max_in_flight, settings.timeout_s, replicas=router.healthy_count,
                     token_budget=cache_tokens if settings.token_bound else None, planner=planner, observer=metrics,
                     policy=policy)


def build_fleet(config: ServerConfig, service: ProxyService, router: Router) -> FleetView:
    """The router's fleet view, told each replica's KV cache in tokens (cache-fit admission's sizes; unknown
    without them) and the tokens per character (cache-fit admission's calibration), and following the block orders
    sent to each replica when the ``pick`` policy picks by them."""
    fleet = router.fleet

    def capacity(replica: int) -> int | None:
        fit = service.fit
        return fit.capacities[replica] if fit is not None and 0 <= replica < len(fit.capacities) else None

    def tokens_per_char() -> float:
        fit = service.fit
        return fleet_tokens_per_char() if fit is None else max(fit.tokens_per_char, 1e-6)

    fleet_tokens_per_char = fleet.tokens_per_char
    fleet.capacity_tokens = capacity
    fleet.tokens_per_char = tokens_per_char
    fleet.follow_orders = config.hold.policy == "pick"
    return fleet


def fleet_cache_tokens(config: ServerConfig, fit: CacheFit | None) -> int | None:
    """The KV cache of every replica together (a held window spreads over them): the sizes cache-fit admission
    read from the engines when all are known, else ``replica_cache_tokens`` when given, else None (unknown)."""
    if fit is not None and fit.capacities and all(size is not None for size in fit.capacities):
        return sum(size for size in fit.capacities if size is not None)
    if "replica_cache_tokens" in config.model_fields_set:
        return config.replica_cache_tokens * max(1, len(config.engines))
    return None


def fit_settings(config: ServerConfig) -> FitSettings:
    """Cache-fit admission's tunables from ``config.fit`` and its ablations in ``config.experimental``."""
    fit = config.fit
    return FitSettings(fill=fit.fill, idle_s=fit.idle_ms / 1000.0, first_idle_s=fit.first_idle_ms / 1000.0,
                       grace_s=fit.grace_ms / 1000.0, max_wait_s=fit.max_wait_s,
                       learn_idle=config.experimental.fit_learn_idle, move=config.experimental.fit_move)


def build_fit(config: ServerConfig, metrics: ProxyMetrics) -> CacheFit | None:
    """Cache-fit admission (cpmemory.server.fit) when on: one pool per replica (one for the fleet behind a gateway,
    unless its replicas' KV events tell which replica served each turn), sized by ``replica_cache_tokens`` when it
    is given; :func:`size_fit` reads the engines' sizes."""
    if not config.fit.enabled:
        return None
    given = config.replica_cache_tokens if "replica_cache_tokens" in config.model_fields_set else None
    if config.attributes_gateway:  # one pool per replica behind the gateway: its KV events say which served a turn
        pools, size = len(config.engines), given
    elif config.upstream is not None:  # the fleet's cache: every replica behind the gateway (one if none is named)
        pools, size = 1, None if given is None else given * max(1, len(config.engines))
    else:
        pools, size = len(config.engines), given
    return CacheFit([size] * pools, fit_settings(config), observer=metrics)


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
