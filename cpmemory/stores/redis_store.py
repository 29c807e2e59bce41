"""Session state in Redis: two-phase turns, one round trip each, tenant-isolated, cluster-ready.

Every operation is one Lua script run by SHA (``EVALSHA``; reloaded on ``NOSCRIPT``, e.g. after a server restart)
over the five keys of one conversation (see :mod:`cpmemory.stores.keys`), which share one hash tag and therefore one
Redis Cluster slot. The scripts live in ``cpmemory/stores/lua/*.lua`` with their ``KEYS``/``ARGV`` contract at the
top; ``common.lua`` is prepended to each. They are registered with redis-py's ``register_script``; on a standalone
synchronous client they are sent by :class:`DirectScriptRunner` (see there why), otherwise by redis-py's ``Script``.

The request encoding and the reply decoding are sans-IO (:class:`RedisSessionCodec`), shared by the synchronous
:class:`RedisSessionStore` (``redis.Redis`` / ``redis.cluster.RedisCluster``) and the asyncio
:class:`AsyncRedisSessionStore` (``redis.asyncio.Redis`` / ``redis.asyncio.cluster.RedisCluster``); those two only
do IO. Any Redis or socket failure is raised as :class:`~cpmemory.errors.StoreUnavailableError` (the facade then
serves the turn pass-through); the redis-py client reconnects by itself when the server is back.

Clients must be created with ``decode_responses=False`` (the default): ids are binary-safe byte strings.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cpmemory.errors import (
    InvalidInputError,
    MissingDependencyError,
    StoreUnavailableError,
)
from cpmemory.stores.base import (
    ConversationKey,
    ConversationState,
    Reservation,
    ReserveRequest,
    TurnRecord,
)
from cpmemory.stores.decisions import DecisionCodec, DecisionLimits, distinct_sizes
from cpmemory.stores.keys import KeyScheme, decode_text
from cpmemory.stores.redis_codec import (
    RedisSessionCodec,
    RedisStoreConfig,
    ScriptCall,
    load_script_sources,
    new_reservation_id,
)


def _redis_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the store is unavailable": every redis-py error (RedisClusterException is not a
    RedisError), socket errors and timeouts."""
    try:
        from redis.exceptions import RedisClusterException, RedisError
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("redis", "redis") from error
    return (RedisError, RedisClusterException, OSError, TimeoutError)


@contextmanager
def _unavailable_on_failure(errors: tuple[type[BaseException], ...], operation: str) -> Iterator[None]:
    try:
        yield
    except errors as error:
        raise StoreUnavailableError(f"redis {operation} failed: {type(error).__name__}: {error}") from error


class DirectScriptRunner:
    """Runs the registered scripts on connections kept out of a standalone ``redis.Redis`` client's pool.

    Why: on loopback, redis-py's generic command path (pool checkout with a readiness poll and locks, the retry
    wrapper, observability hooks and event dispatch) costs about as much as the round trip itself. The hot path
    only needs ``EVALSHA`` on a connected socket, so each thread takes a connection from a small idle stack
    (``list.pop``/``append`` are atomic), sends, reads, and puts it back. A connection that failed is disconnected and
    handed back to the pool; a ``ConnectionError`` (a stale socket after a server restart, or a refused connect)
    is retried on a fresh connection ``retries`` times (at least once). ``NOSCRIPT`` loads the script on the same
    connection and retries, so a restarted server recovers by itself. After a fork the idle stack is dropped.
    The idle stack belongs to the pool, shared by every runner (store) on it: many stores on one client hold no
    more connections than run at once, so they never run a bounded pool dry.
    """

    def __init__(self, client: Any, scripts: dict[str, Any], retries: int) -> None:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import NoScriptError

        self._pool = client.connection_pool
        self._scripts = scripts
        self._idle: list[Any] = _idle_stack(self._pool)
        self._pid = os.getpid()
        self._attempts = 1 + max(1, retries)
        self._retryable = RedisConnectionError
        self._no_script = NoScriptError

    def __call__(self, call: ScriptCall) -> Any:
        """Run one script call: one round trip (three the first time a server sees the script)."""
        script = self._scripts[call.script]
        return self._on_connection(lambda connection: self._evalsha(connection, script, call))

    def run_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Run several script calls in one round trip (one write, then the replies in order).

        A reply that is an error is returned as the exception (the caller decides); a ``NOSCRIPT`` reply loads
        that script and runs its call again on the same connection (the first time a server sees the script).
        """
        return self._on_connection(lambda connection: self._pipelined(connection, calls))

    def _on_connection(self, send: Callable[[Any], Any]) -> Any:
        """Run ``send`` on an idle connection, retrying a retryable error on a fresh one; a broken connection goes
        back to the pool disconnected, a healthy one to the idle stack."""
        for attempt in range(self._attempts):
            connection = self._checkout()
            try:
                reply = send(connection)
            except BaseException as error:
                connection.disconnect()
                self._pool.release(connection)
                if isinstance(error, self._retryable) and attempt + 1 < self._attempts:
                    continue
                raise
            self._idle.append(connection)
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    def _pipelined(self, connection: Any, calls: Sequence[ScriptCall]) -> list[Any]:
        from redis.exceptions import ResponseError

        packed = [("EVALSHA", self._scripts[c.script].sha, len(c.keys), *c.keys, *c.args) for c in calls]
        connection.send_packed_command(connection.pack_commands(packed))
        replies: list[Any] = []
        for _ in calls:
            try:
                replies.append(connection.read_response())
            except ResponseError as error:  # NoScriptError is one; the other replies are still read
                replies.append(error)
        for position, (call, reply) in enumerate(zip(calls, replies)):
            if isinstance(reply, self._no_script):
                try:
                    replies[position] = self._evalsha(connection, self._scripts[call.script], call)
                except ResponseError as error:
                    replies[position] = error
        return replies

    def _checkout(self) -> Any:
        if self._pid != os.getpid():  # never share a parent's sockets
            self._idle, self._pid = _idle_stack(self._pool), os.getpid()
        try:
            return self._idle.pop()
        except IndexError:
            return self._pool.get_connection()

    def _evalsha(self, connection: Any, script: Any, call: ScriptCall) -> Any:
        try:
            connection.send_command("EVALSHA", script.sha, len(call.keys), *call.keys, *call.args)
            return connection.read_response()
        except self._no_script:
            connection.send_command("SCRIPT", "LOAD", script.script)
            script.sha = decode_text(connection.read_response())
            connection.send_command("EVALSHA", script.sha, len(call.keys), *call.keys, *call.args)
            return connection.read_response()

    def close(self) -> None:
        """Hand the idle connections back to the pool."""
        while True:
            try:
                connection = self._idle.pop()
            except IndexError:
                return
            self._pool.release(connection)


_IDLE_ATTRIBUTE = "_cpmemory_idle_connections"


def _idle_stack(pool: Any) -> list[Any]:
    """The idle connections of ``pool`` shared by the DirectScriptRunners on it, one stack per process."""
    entry = getattr(pool, _IDLE_ATTRIBUTE, None)
    if entry is None or entry[0] != os.getpid():
        entry = (os.getpid(), [])
        setattr(pool, _IDLE_ATTRIBUTE, entry)
    return entry[1]


def _direct_runner(client: Any, scripts: dict[str, Any], retries: int) -> DirectScriptRunner | None:
    """A DirectScriptRunner for a standalone synchronous client with a standard pool; None otherwise."""
    import redis

    pool = getattr(client, "connection_pool", None)
    if isinstance(client, redis.Redis) and isinstance(pool, redis.ConnectionPool):
        return DirectScriptRunner(client, scripts, retries)
    return None


class _RedisStoreBase:
    """What both stores share: config, codec, and the registered scripts of one client."""

    def __init__(self, client: Any, config: RedisStoreConfig | None = None) -> None:
        encoder = getattr(client, "get_encoder", None)
        if encoder is not None and getattr(encoder(), "decode_responses", False):
            raise InvalidInputError("the Redis client must use decode_responses=False (ids are binary-safe bytes)")
        self.config = config or RedisStoreConfig()
        self.client = client
        self._codec = RedisSessionCodec(self.config)
        self._decisions = DecisionCodec(
            self._codec.keys, DecisionLimits(ttl_ms=self._codec.ttl_ms)
        )
        self._errors = _redis_errors()
        # register_script only hashes the text locally (no IO); the first EVALSHA loads it on NOSCRIPT.
        self._scripts = {name: client.register_script(text) for name, text in load_script_sources().items()}

    @property
    def key_scheme(self) -> KeyScheme:
        """The key naming in use (for inspection and cleanup tools)."""
        return self._codec.keys


class RedisSessionStore(_RedisStoreBase):
    """Synchronous SessionStore on ``redis.Redis`` or ``redis.cluster.RedisCluster``. One round trip per call.

    Thread-safe. On a standalone ``redis.Redis`` the scripts run through :class:`DirectScriptRunner` (pass
    ``direct=False`` to use redis-py's generic ``Script`` path instead, e.g. to keep a custom retry policy);
    cluster clients always use ``Script``.
    """

    @classmethod
    def from_url(cls, url: str, config: RedisStoreConfig | None = None, *, cluster: bool = False) -> RedisSessionStore:
        """Create a store with a new client for ``url`` using the config's timeouts (connects lazily)."""
        config = config or RedisStoreConfig()
        try:
            import redis
            from redis.cluster import RedisCluster
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("redis", "redis") from error
        factory = RedisCluster.from_url if cluster else redis.Redis.from_url
        # redis-py's RedisCluster connects in its constructor (to discover the slots).
        with _unavailable_on_failure(_redis_errors(), "connect"):
            client = factory(url, **config.client_kwargs())
        return cls(client, config)

    def __init__(self, client: Any, config: RedisStoreConfig | None = None, *, direct: bool = True) -> None:
        super().__init__(client, config)
        self._direct = _direct_runner(client, self._scripts, self.config.retries) if direct else None

    def _run(self, call: ScriptCall) -> Any:
        with _unavailable_on_failure(self._errors, call.script):
            if self._direct is not None:
                return self._direct(call)
            return self._scripts[call.script](keys=call.keys, args=call.args)

    def _run_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Several calls in one round trip (a pipeline); error replies come back as exceptions."""
        with _unavailable_on_failure(self._errors, "+".join(call.script for call in calls)):
            if self._direct is not None:
                replies = self._direct.run_many(calls)
            else:
                pipe = self.client.pipeline(transaction=False)
                for call in calls:
                    self._scripts[call.script](keys=call.keys, args=call.args, client=pipe)
                replies = pipe.execute(raise_on_error=False)
        if isinstance(replies[0], Exception):
            raise StoreUnavailableError(f"redis {calls[0].script} failed: {replies[0]}") from replies[0]
        return replies

    def reserve(self, key: ConversationKey, request: ReserveRequest) -> Reservation:
        """Record a reservation and return the committed state the request needs. One round trip; mutates.

        With ``request.order_sizes`` the tenant's shared decision state orders the request in the same round trip
        (``Reservation.shared_order``; None when that part failed: the caller orders locally).
        """
        reservation_id = new_reservation_id()
        call = self._codec.reserve_call(key, request, reservation_id)
        if request.order_sizes is None:
            return self._codec.parse_reserve(self._run(call), request, reservation_id)
        hashes, sizes = distinct_sizes(request.blocks, request.order_sizes)
        order = ScriptCall(*self._decisions.order_call(key.tenant, hashes, sizes))
        reply, ordered = self._run_many([call, order])
        reservation = self._codec.parse_reserve(reply, request, reservation_id)
        if isinstance(ordered, Exception):
            return reservation
        return dataclasses.replace(reservation, shared_order=self._decisions.parse_order(ordered))

    def commit(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> int:
        """Make the reserved turn durable; idempotent per reservation. One round trip; mutates.

        With ``record.sent_order`` the order sent is recorded in the tenant's shared decision state in the same
        round trip.
        """
        call = self._codec.commit_call(key, reservation_id, record)
        if not record.sent_order or not record.request_id:
            return self._codec.parse_commit(self._run(call), reservation_id)
        recorded = ScriptCall(*self._decisions.record_call(key.tenant, record.sent_order, record.request_id))
        reply, _ = self._run_many([call, recorded])
        return self._codec.parse_commit(reply, reservation_id)

    def decide_order(self, tenant: str, hashes: Sequence[str], sizes: Sequence[float], request_id: str) -> list[str]:
        """Order and record a request outside any conversation in the tenant's shared state. One round trip."""
        call = ScriptCall(*self._decisions.order_call(tenant, hashes, sizes, request_id, record=True))
        return list(self._decisions.parse_order(self._run(call)))

    def evict_decisions(self, tenant: str, request_ids: Sequence[str]) -> int:
        """Take evicted requests off the tenant's shared decision state. One round trip."""
        if not request_ids:
            return 0
        return int(self._run(ScriptCall(*self._decisions.evict_call(tenant, list(request_ids)))))

    def abort(self, key: ConversationKey, reservation_id: str) -> bool:
        """Release a reservation; False if it was not open. One round trip; mutates."""
        return bool(self._run(self._codec.abort_call(key, reservation_id)))

    def load(self, key: ConversationKey) -> ConversationState:
        """Read the whole conversation (not on the hot path). One round trip; refreshes the TTL."""
        return self._codec.parse_load(self._run(self._codec.load_call(key)))

    def delete(self, key: ConversationKey) -> None:
        """Forget the conversation. One round trip (its keys share one slot)."""
        with _unavailable_on_failure(self._errors, "delete"):
            self.client.delete(*self._codec.key_names(key))

    def close(self) -> None:
        """Close the client's connections."""
        if self._direct is not None:
            self._direct.close()
        self.client.close()


class AsyncRedisSessionStore(_RedisStoreBase):
    """Asyncio SessionStore on ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``."""

    @classmethod
    def from_url(
        cls, url: str, config: RedisStoreConfig | None = None, *, cluster: bool = False
    ) -> AsyncRedisSessionStore:
        """Create a store with a new asyncio client for ``url`` using the config's timeouts (connects lazily)."""
        config = config or RedisStoreConfig()
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.cluster import RedisCluster
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("redis", "redis") from error
        factory = RedisCluster.from_url if cluster else aioredis.Redis.from_url
        return cls(factory(url, **config.client_kwargs()), config)

    def __init__(self, client: Any, config: RedisStoreConfig | None = None) -> None:
        super().__init__(client, config)
        self._initialized = False
        self._initializing: asyncio.Lock | None = None

    async def _initialize_once(self) -> None:
        # redis.asyncio.RedisCluster can race when many first commands run concurrently on a fresh client (one
        # task's topology refresh closes connections another task is opening): initialise it once, up front.
        initialize = getattr(self.client, "initialize", None)
        if initialize is not None and hasattr(self.client, "nodes_manager"):
            if self._initializing is None:
                self._initializing = asyncio.Lock()
            async with self._initializing:
                if not self._initialized:
                    await initialize()
        self._initialized = True

    async def _run(self, call: ScriptCall) -> Any:
        with _unavailable_on_failure(self._errors, call.script):
            if not self._initialized:
                await self._initialize_once()
            return await self._scripts[call.script](keys=call.keys, args=call.args)

    async def _run_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Several calls in one round trip (a pipeline); error replies come back as exceptions."""
        with _unavailable_on_failure(self._errors, "+".join(call.script for call in calls)):
            if not self._initialized:
                await self._initialize_once()
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                await self._scripts[call.script](keys=call.keys, args=call.args, client=pipe)
            replies = await pipe.execute(raise_on_error=False)
        if isinstance(replies[0], Exception):
            raise StoreUnavailableError(f"redis {calls[0].script} failed: {replies[0]}") from replies[0]
        return replies

    async def reserve(self, key: ConversationKey, request: ReserveRequest) -> Reservation:
        """Record a reservation and return the committed state the request needs. One round trip; mutates.

        See :meth:`RedisSessionStore.reserve` (``order_sizes``: the shared order in the same round trip).
        """
        reservation_id = new_reservation_id()
        call = self._codec.reserve_call(key, request, reservation_id)
        if request.order_sizes is None:
            return self._codec.parse_reserve(await self._run(call), request, reservation_id)
        hashes, sizes = distinct_sizes(request.blocks, request.order_sizes)
        order = ScriptCall(*self._decisions.order_call(key.tenant, hashes, sizes))
        reply, ordered = await self._run_many([call, order])
        reservation = self._codec.parse_reserve(reply, request, reservation_id)
        if isinstance(ordered, Exception):
            return reservation
        return dataclasses.replace(reservation, shared_order=self._decisions.parse_order(ordered))

    async def commit(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> int:
        """Make the reserved turn durable; idempotent per reservation. One round trip; mutates (and records the
        order sent in the tenant's shared decision state, see :meth:`RedisSessionStore.commit`)."""
        call = self._codec.commit_call(key, reservation_id, record)
        if not record.sent_order or not record.request_id:
            return self._codec.parse_commit(await self._run(call), reservation_id)
        recorded = ScriptCall(*self._decisions.record_call(key.tenant, record.sent_order, record.request_id))
        reply, _ = await self._run_many([call, recorded])
        return self._codec.parse_commit(reply, reservation_id)

    async def evict_decisions(self, tenant: str, request_ids: Sequence[str]) -> int:
        """Take evicted requests off the tenant's shared decision state. One round trip."""
        if not request_ids:
            return 0
        return int(await self._run(ScriptCall(*self._decisions.evict_call(tenant, list(request_ids)))))

    async def abort(self, key: ConversationKey, reservation_id: str) -> bool:
        """Release a reservation; False if it was not open. One round trip; mutates."""
        return bool(await self._run(self._codec.abort_call(key, reservation_id)))

    async def load(self, key: ConversationKey) -> ConversationState:
        """Read the whole conversation (not on the hot path). One round trip; refreshes the TTL."""
        return self._codec.parse_load(await self._run(self._codec.load_call(key)))

    async def delete(self, key: ConversationKey) -> None:
        """Forget the conversation. One round trip (its keys share one slot)."""
        with _unavailable_on_failure(self._errors, "delete"):
            if not self._initialized:
                await self._initialize_once()
            await self.client.delete(*self._codec.key_names(key))

    async def close(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()
