"""The proxy's session store: built from its URL, checked before the proxy serves, probed for readiness.

``ServerConfig.redis_url`` takes one of these schemes (``cpmemory serve --redis URL``)::

    redis://HOST:PORT/DB           one Redis server (rediss:// with TLS, unix:///path/to/socket)
    redis+cluster://HOST:PORT      a Redis Cluster, reached through any of its nodes (rediss+cluster:// with TLS)

No URL keeps the sessions in process memory. :func:`check_store` is what ``cpmemory serve`` runs before it listens:
a store that cannot be used as configured (unreachable, a cluster node given as ``redis://``, a server without
cluster mode given as ``redis+cluster://``, scripts refused) stops the start with a message that says what to change,
instead of a proxy that serves every turn pass-through. :func:`store_ready` is the readiness probe's check.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from cpmemory.errors import InvalidInputError, StoreUnavailableError
from cpmemory.server.config import ServerConfig
from cpmemory.stores.base import AsyncSessionStore
from cpmemory.types import ConversationKey

CLUSTER_SUFFIX = "+cluster"
STANDALONE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis" + CLUSTER_SUFFIX, "rediss" + CLUSTER_SUFFIX)
PROBE_KEY = ConversationKey("cpmemory-probe", "readiness")
"""The conversation a check reads (never written: reading an absent conversation stores nothing)."""


class StoreConfigurationError(InvalidInputError):
    """The session store answers, but not as the URL says it should be used (e.g. a cluster node as one server)."""


@dataclass(frozen=True, slots=True)
class StoreUrl:
    """A parsed ``redis_url``: the URL redis-py takes and whether it names a cluster."""

    client_url: str
    cluster: bool


def parse_store_url(url: str) -> StoreUrl:
    """Split ``redis+cluster://`` into redis-py's URL and the cluster flag. Pure.

    Raises:
        InvalidInputError: an unknown scheme, or a cluster URL that names a database other than 0 (a cluster has
            only database 0).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in STANDALONE_SCHEMES:
        return StoreUrl(url, cluster=False)
    if scheme not in CLUSTER_SCHEMES:
        known = ", ".join(f"{name}://" for name in (*STANDALONE_SCHEMES, *CLUSTER_SCHEMES))
        raise InvalidInputError(f"unknown session store scheme {parts.scheme!r}: use one of {known}")
    if parts.path.strip("/") not in ("", "0"):
        raise InvalidInputError("a Redis Cluster has only database 0: drop the database from the redis+cluster:// URL")
    plain = scheme.removesuffix(CLUSTER_SUFFIX)
    return StoreUrl(urlunsplit((plain, parts.netloc, "", parts.query, parts.fragment)), cluster=True)


def redacted(url: str) -> str:
    """The URL without its password (for logs). Pure."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def build_store(config: ServerConfig) -> AsyncSessionStore:
    """The session store the config asks for: Redis or a Redis Cluster (``redis_url`` with ``config.redis``), else
    in process memory. No IO (the clients connect on first use)."""
    if config.redis_url is None:
        from cpmemory.stores.memory import AsyncInMemorySessionStore

        return AsyncInMemorySessionStore(ttl_s=config.memory.ttl_s)
    from cpmemory.stores.redis_store import AsyncRedisSessionStore

    parsed = parse_store_url(config.redis_url)
    return AsyncRedisSessionStore.from_url(parsed.client_url, config.redis, cluster=parsed.cluster)


def describe_store(config: ServerConfig) -> str:
    """One phrase for the start line: which store, where (password hidden). Pure."""
    if config.redis_url is None:
        return "in process memory (lost on restart)"
    kind = "Redis Cluster" if parse_store_url(config.redis_url).cluster else "Redis"
    return f"{kind} {redacted(config.redis_url)} (prefix {config.redis.prefix})"


async def check_store(store: AsyncSessionStore) -> None:
    """Check that ``store`` can serve turns as configured: reachable, a cluster only when given as one, its scripts
    run. Reads only. A store in process memory always can.

    Raises:
        StoreUnavailableError: the store cannot be reached, or refuses the scripts.
        StoreConfigurationError: a Redis Cluster node given as ``redis://``, or a server without cluster mode given
            as ``redis+cluster://``.
    """
    client = getattr(store, "client", None)
    if client is None:
        return
    from redis.exceptions import AuthenticationError, RedisClusterException, RedisError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    is_cluster = hasattr(client, "nodes_manager")
    try:
        if is_cluster:
            await client.initialize()
        else:
            info = await client.info("cluster")
            if int(info.get("cluster_enabled", 0)):
                raise StoreConfigurationError(
                    "the Redis server is a node of a Redis Cluster: give the store as redis+cluster://HOST:PORT")
    except RedisClusterException as error:
        if "cluster mode is not enabled" in str(error).lower():
            raise StoreConfigurationError("the Redis server does not run in cluster mode: give the store as "
                                          "redis://HOST:PORT/DB, not redis+cluster://") from error
        raise StoreUnavailableError(f"the Redis Cluster cannot be used: {error}") from error
    except AuthenticationError as error:  # a ConnectionError to redis-py, but the server answered
        raise StoreUnavailableError(f"the Redis store refused the credentials: {error} (give them in the URL: "
                                    "redis://USER:PASSWORD@HOST:PORT/DB)") from error
    except (RedisConnectionError, RedisTimeoutError, OSError) as error:
        raise StoreUnavailableError(f"the Redis store cannot be reached: {type(error).__name__}: {error}") from error
    except RedisError as error:  # e.g. a password required or refused, a command disabled
        raise StoreUnavailableError(f"the Redis store refused the check: {type(error).__name__}: {error}") from error
    await store.load(PROBE_KEY)


async def store_ready(store: AsyncSessionStore) -> tuple[bool, str]:
    """Whether ``store`` serves a read now (the readiness probe), and why not. Never raises."""
    client = getattr(store, "client", None)
    if client is None:
        return True, "in process memory"
    try:
        await store.load(PROBE_KEY)
    except StoreUnavailableError as error:
        return False, str(error)
    return True, "answers"
