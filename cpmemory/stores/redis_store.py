"""Session state in Redis: two-phase turns, one round trip each, tenant-isolated, cluster-ready.

Every operation is one Lua script run by SHA (``EVALSHA``; reloaded on ``NOSCRIPT``, e.g. after a server restart)
over the five keys of one conversation or the keys of its tenant's shared decision state (see
:mod:`cpmemory.stores.keys`): every key of one tenant shares the tenant's hash tag and therefore one Redis Cluster
slot, so a request's two calls (the conversation's and the decisions') are one pipeline to one node. The scripts
live in ``cpmemory/stores/lua/*.lua`` with their ``KEYS``/``ARGV`` contract at the top; ``common.lua`` is prepended
to each. They are registered with redis-py's ``register_script``; on a synchronous client they are sent by
:class:`~cpmemory.stores.redis_runner.DirectScriptRunner` (standalone) or
:class:`~cpmemory.stores.redis_runner.ClusterScriptRunner` (cluster; see there why), otherwise pipelined through
redis-py (:mod:`cpmemory.stores.redis_runner`).

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
from collections.abc import Iterator, Sequence
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
from cpmemory.stores.decisions import DecisionCodec, DecisionLimits, GapTracker, check_trie, distinct_sizes
from cpmemory.stores.keys import KeyScheme
from cpmemory.stores.redis_codec import (
    RedisSessionCodec,
    RedisStoreConfig,
    ScriptCall,
    load_script_sources,
    new_reservation_id,
)
from cpmemory.stores.redis_runner import direct_runner, run_pipelined, run_pipelined_async


def _redis_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the store is unavailable": every redis-py error (RedisClusterException is not a
    RedisError), socket errors and timeouts."""
    try:
        from redis.exceptions import RedisClusterException, RedisError
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("redis", "redis") from error
    return (RedisError, RedisClusterException, OSError, TimeoutError)


@contextmanager
def _unavailable_on_failure(
    errors: tuple[type[BaseException], ...], operation: str, gaps: GapTracker | None = None
) -> Iterator[None]:
    """Map Redis / socket errors to StoreUnavailableError; with ``gaps``, tell it when a call failed."""
    try:
        yield
    except errors as error:
        if gaps is not None:
            gaps.failed()
        raise StoreUnavailableError(f"redis {operation} failed: {type(error).__name__}: {error}") from error


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
        self._gaps = GapTracker()  # after an outage, each tenant's next decision distrusts the shared trie
        self._errors = _redis_errors()
        # register_script only hashes the text locally (no IO); the first EVALSHA loads it on NOSCRIPT.
        self._scripts = {name: client.register_script(text) for name, text in load_script_sources().items()}

    @property
    def key_scheme(self) -> KeyScheme:
        """The key naming in use (for inspection and cleanup tools)."""
        return self._codec.keys

    def distrust_decisions(self, tenant: str | None = None) -> None:
        """The engine's cache was cleared (for ``tenant``, or all tenants): the tenant's next decision call makes
        the shared state ignore every order recorded before now. No IO (safe from any thread)."""
        self._gaps.distrust(tenant)


class RedisSessionStore(_RedisStoreBase):
    """Synchronous SessionStore on ``redis.Redis`` or ``redis.cluster.RedisCluster``. One round trip per call.

    Thread-safe. On a standalone ``redis.Redis`` the scripts run through
    :class:`~cpmemory.stores.redis_runner.DirectScriptRunner`, on a ``RedisCluster`` through
    :class:`~cpmemory.stores.redis_runner.ClusterScriptRunner` (a direct runner per node; redirections go through
    the cluster client); pass ``direct=False`` to go through redis-py's command path instead (e.g. to keep a custom
    retry policy).
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
        self._direct = direct_runner(client, self._scripts, self.config.retries) if direct else None

    def _run(self, call: ScriptCall) -> Any:
        with _unavailable_on_failure(self._errors, call.script, self._gaps):
            if self._direct is not None:
                return self._direct(call)
            return self._scripts[call.script](keys=call.keys, args=call.args)

    def _run_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Several calls in one round trip (a pipeline); error replies come back as exceptions."""
        with _unavailable_on_failure(self._errors, "+".join(call.script for call in calls), self._gaps):
            if self._direct is not None:
                replies = self._direct.run_many(calls)
            else:
                replies = run_pipelined(self.client, calls, self._scripts)
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
        gap = self._gaps.argument(key.tenant)
        order = self._decisions.order_call(key.tenant, hashes, sizes, gap=gap, match=request.match_prefix)
        reply, ordered = self._run_many([call, order.call])
        reservation = self._codec.parse_reserve(reply, request, reservation_id)
        if isinstance(ordered, Exception):
            return reservation
        self._gaps.reported(key.tenant, gap)
        return dataclasses.replace(reservation, shared_order=order.parse(ordered))

    def commit(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> int:
        """Make the reserved turn durable; idempotent per reservation. One round trip; mutates.

        With ``record.sent_order`` the order sent is recorded in the tenant's shared decision state in the same
        round trip.
        """
        call = self._codec.commit_call(key, reservation_id, record)
        if not record.sent_order or not record.request_id:
            return self._codec.parse_commit(self._run(call), reservation_id)
        gap = self._gaps.argument(key.tenant)
        recorded = self._decisions.record_call(key.tenant, record.sent_order, record.request_id, gap)
        reply, outcome = self._run_many([call, recorded])
        if not isinstance(outcome, Exception):
            self._gaps.reported(key.tenant, gap)
        return self._codec.parse_commit(reply, reservation_id)

    def decide_order(self, tenant: str, hashes: Sequence[str], sizes: Sequence[float], request_id: str) -> list[str]:
        """Order and record a request outside any conversation in the tenant's shared state. Two round trips
        (order, then record the order; another worker's request may land between them, as with two turns)."""
        gap = self._gaps.argument(tenant)
        order = self._decisions.order_call(tenant, hashes, sizes, gap=gap)
        decided = order.decided(self._run(order.call))
        self._gaps.reported(tenant, gap)
        if request_id and decided:
            self._run(self._decisions.record_call(tenant, decided, request_id))
        return decided

    def evict_decisions(self, tenant: str, request_ids: Sequence[str]) -> int:
        """Take evicted requests off the tenant's shared decision state. One round trip."""
        if not request_ids:
            return 0
        gap = self._gaps.argument(tenant)
        removed = int(self._run(self._decisions.evict_call(tenant, list(request_ids), gap)))
        self._gaps.reported(tenant, gap)
        return removed

    def check_decisions(self, tenant: str) -> None:
        """Check the tenant's shared decision state (:func:`cpmemory.stores.decisions.check_trie`; raises
        IndexIntegrityError). Reads the whole state: for tests and tools."""
        trie, _, _, paths, fifo = self._codec.keys.decision_keys(tenant)
        with _unavailable_on_failure(self._errors, "check"):
            check_trie(self.client.hgetall(trie), self.client.hgetall(paths), self.client.zrange(fifo, 0, -1))

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
        return cls(factory(url, **config.client_kwargs(asyncio=True)), config)

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
        with _unavailable_on_failure(self._errors, call.script, self._gaps):
            if not self._initialized:
                await self._initialize_once()
            return await self._scripts[call.script](keys=call.keys, args=call.args)

    async def _run_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Several calls in one round trip (a pipeline); error replies come back as exceptions."""
        with _unavailable_on_failure(self._errors, "+".join(call.script for call in calls), self._gaps):
            if not self._initialized:
                await self._initialize_once()
            replies = await run_pipelined_async(self.client, calls, self._scripts)
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
        gap = self._gaps.argument(key.tenant)
        order = self._decisions.order_call(key.tenant, hashes, sizes, gap=gap, match=request.match_prefix)
        reply, ordered = await self._run_many([call, order.call])
        reservation = self._codec.parse_reserve(reply, request, reservation_id)
        if isinstance(ordered, Exception):
            return reservation
        self._gaps.reported(key.tenant, gap)
        return dataclasses.replace(reservation, shared_order=order.parse(ordered))

    async def commit(self, key: ConversationKey, reservation_id: str, record: TurnRecord) -> int:
        """Make the reserved turn durable; idempotent per reservation. One round trip; mutates (and records the
        order sent in the tenant's shared decision state, see :meth:`RedisSessionStore.commit`)."""
        call = self._codec.commit_call(key, reservation_id, record)
        if not record.sent_order or not record.request_id:
            return self._codec.parse_commit(await self._run(call), reservation_id)
        gap = self._gaps.argument(key.tenant)
        recorded = self._decisions.record_call(key.tenant, record.sent_order, record.request_id, gap)
        reply, outcome = await self._run_many([call, recorded])
        if not isinstance(outcome, Exception):
            self._gaps.reported(key.tenant, gap)
        return self._codec.parse_commit(reply, reservation_id)

    async def evict_decisions(self, tenant: str, request_ids: Sequence[str]) -> int:
        """Take evicted requests off the tenant's shared decision state. One round trip."""
        if not request_ids:
            return 0
        gap = self._gaps.argument(tenant)
        removed = int(await self._run(self._decisions.evict_call(tenant, list(request_ids), gap)))
        self._gaps.reported(tenant, gap)
        return removed

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
