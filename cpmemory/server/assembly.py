"""How the proxy is assembled from its configuration: the session store, the facade, cache salts, the hold queue,
cache-fit admission, the tokenizer and the router's view. Every ``build_*`` is free of IO; ``size_fit`` and
``adopt_engine_tokenizer`` run as tasks of the app's lifespan.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from cpmemory.core.blocks import Block
from cpmemory.core.scheduling import ReleasePlan
from cpmemory.engines.client import AsyncEngineClient, EngineSettings
from cpmemory.errors import CpMemoryError, EngineError, EngineUnreachableError
from cpmemory.routing.prefix import EventPrefixView, PrefixView, SentPrefixView
from cpmemory.routing.router import Router
from cpmemory.server.config import ServerConfig
from cpmemory.server.fit import CacheFit
from cpmemory.server.hold import HoldQueue
from cpmemory.server.metrics import ProxyMetrics
from cpmemory.server.pick import SentOrders
from cpmemory.server.salt import CacheSalts
from cpmemory.server.service import ProxyService, TurnMemory
from cpmemory.server.store_setup import build_store
from cpmemory.stores.base import AsyncSessionStore

logger = logging.getLogger(__name__)


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


async def close_store(memory: Any) -> None:
    store = getattr(memory, "store", None)
    closer = getattr(store, "close", None) or getattr(store, "aclose", None)
    if closer is None:
        return
    with contextlib.suppress(Exception):
        result = closer()
        if asyncio.iscoroutine(result):
            await result

