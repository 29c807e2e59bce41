"""How the proxy is assembled from its configuration: the session store, the facade, cache salts, the hold queue,
cache-fit admission, the tokenizer and the router's view. Every ``build_*`` is free of IO; ``size_fit`` and
``adopt_engine_tokenizer`` run as tasks of the app's lifespan.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from cpmemory.errors import EngineError, EngineUnreachableError
from cpmemory.routing.prefix import EventPrefixView, PrefixView, SentPrefixView
from cpmemory.server.admission import (  # noqa: F401 - admission is assembled there (re-exported)
    build_fit,
    build_fleet,
    build_hold,
    fleet_cache_tokens,
    size_fit,
)
from cpmemory.server.config import ServerConfig
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

