"""Keep the proxy's context index in step with what each engine replica evicts (vLLM KV-cache events).

One ``EvictionSync`` and one ``KVEventSubscriber`` (a ZMQ thread) per replica, from ``cpmemory.engines``. After a
turn succeeds on a replica, the proxy registers the prompt it sent there: the replica's ``/tokenize`` gives the token
ids (chat template applied) and the sync computes the chained block hashes. When the replica later reports those
blocks removed, the matching index leaves are evicted from the tenant's index; ``AllBlocksCleared`` or a gap in the
event sequence resets the index (never a silently wrong index).

Registration runs in a background task after the response is sent, so it adds no latency to the request. Its
failures only cost reuse (the leaf stays until the index's own cap evicts it) and are counted.

With prefix-aware routing the same subscribers also feed an :class:`~cpmemory.routing.prefix.EventPrefixView`
(what each replica caches, from its events); the proxy then tokenizes a prompt *before* routing it
(:meth:`KVSyncHub.prompt_blocks`, one ``/tokenize`` call, or none with a local tokenizer: ``--tokenizer``), scores
the replicas by the engine's own block hashes, and registers those hashes for eviction sync without a second call.
Behind a gateway (``--upstream``) the proxy does not know which replica served a request. With the replicas' KV
events it finds out after the answer (:meth:`KVSyncHub.attribute_later`): the same events feed an attribution-only
``EventPrefixView``, the prompt is tokenized once, and the replica that stored its blocks is the one that served it;
the prompt is registered there, and the proxy's cache-fit admission counts the conversation on that replica. When no
replica stands out, the prompt is registered with every replica's sync: its leaf is evicted as soon as any replica
drops one of its blocks (conservative: costs reuse, never claims a cached prefix that is gone).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cpmemory.errors import CpMemoryError, InvalidInputError
from cpmemory.server.clock import Clock, LoopClock, sleep

logger = logging.getLogger(__name__)
MAX_PENDING_REGISTRATIONS = 1024
TOKENIZE_TIMEOUT_S = 2.0
ATTRIBUTE_RETRY_S = (0.05, 0.2, 0.5, 1.0, 2.0, 4.0)
"""Behind a gateway: the waits (about 8 s in all) for KV events that name the replica of an answered prompt. The
events usually trail the answer by milliseconds, but a loaded machine can delay them by a second or more (a single
short wait left turns of a loaded CI run unattributed, see ``KVEventSubscriber.start``); the wait runs in the
background and costs no request anything."""
ATTRIBUTE_TOKENIZE_TIMEOUT_S = 30.0
"""Behind a gateway: the tokenize call of attribution, off the request path, may wait longer than routing's."""


@dataclass(slots=True)
class _Replica:
    url: str
    sync: Any
    subscriber: Any
    client: Any  # the replica's AsyncEngineClient (on the hub's shared pool)


@dataclass(slots=True)
class KVSyncHub:
    """Eviction sync for every replica that has a KV-event endpoint. Use from one event loop.

    Attributes:
        memory: the facade (its ``evict`` / ``reset_index``).
        engines: the replicas' base URLs (``/tokenize`` and ``/metrics`` are called there).
        endpoints: their KV-event endpoints, in the same order.
        view: a prefix view fed by the same events (None: eviction sync only).
        tokenizer: a :class:`~cpmemory.engines.local_tokenizer.LocalTokenizer` of the served model: prompts are
            tokenized here instead of by the replica's ``/tokenize`` (None: ask the replica).
        failures: registrations or tokenizations that failed (they only cost reuse).
        clock: the time attribution waits by (the event loop's; a ``ManualClock`` in tests).
    """

    memory: Any
    engines: Sequence[str]
    endpoints: Sequence[str]
    view: Any = None
    tokenizer: Any = None
    failures: int = 0
    clock: Clock = field(default_factory=LoopClock)
    _replicas: dict[int, _Replica] = field(default_factory=dict)
    _pending: set[asyncio.Task] = field(default_factory=set)
    _http: Any = None

    def __post_init__(self) -> None:
        if self.endpoints and len(self.endpoints) != len(self.engines):
            raise InvalidInputError("give one KV-event endpoint per engine, in the same order")

    async def start(self) -> None:
        """Read each replica's cache config (one ``/metrics`` call) and start its subscriber thread.

        A replica whose config cannot be read runs without eviction sync (logged, counted); the proxy still serves.
        """
        import httpx

        from cpmemory.engines.client import AsyncEngineClient, EngineSettings
        from cpmemory.engines.eviction_sync import EvictionSync
        from cpmemory.engines.kv_events import KVEventSubscriber
        from cpmemory.routing.prefix import TeeHandler

        self._http = httpx.AsyncClient()
        for index, (url, endpoint) in enumerate(zip(self.engines, self.endpoints)):
            client = AsyncEngineClient(EngineSettings(base_url=url, timeout_s=30.0), http=self._http)
            try:
                config = await client.cache_config()
                sync = EvictionSync.for_engine(self.memory.index_evictor(), _ConfigOnce(config))
                handler: Any = sync
                if self.view is not None:
                    self.view.set_capacity(index, config.num_blocks)
                    handler = TeeHandler(sync, self.view.handler(index))
                subscriber = await asyncio.to_thread(KVEventSubscriber(endpoint, handler).start)
            except (CpMemoryError, OSError) as error:
                logger.warning("no eviction sync for replica %d (%s): %s", index, url, error)
                self.failures += 1
                continue
            self._replicas[index] = _Replica(url.rstrip("/"), sync, subscriber, client)

    async def prompt_blocks(self, payload: Mapping[str, Any], healthy: Sequence[str] | None = None,
                            timeout_s: float = TOKENIZE_TIMEOUT_S) -> Any:
        """The prompt's blocks keyed by the engine's hashes (``/tokenize`` on a replica), or None on failure.

        ``healthy`` names the replicas in rotation (base URLs), preferred first: the first synced one of them
        tokenizes, within ``timeout_s`` (routing: ``TOKENIZE_TIMEOUT_S``; a slow answer only costs the prefix score). Returns a ``PromptBlocks``; its hashes
        are those ``register`` would compute, so the caller registers them directly.
        """
        from cpmemory.routing.prefix import engine_blocks

        if healthy is None:
            usable = list(self._replicas.values())
        else:
            by_url = {state.url: state for state in self._replicas.values()}
            usable = [by_url[url.rstrip("/")] for url in healthy if url.rstrip("/") in by_url]
        if not usable:
            return None
        state = usable[0]
        try:
            tokens = await asyncio.wait_for(self._tokenizer_of(state).tokenize(
                payload.get("messages") or [], model=str(payload.get("model", ""))), timeout_s)
        except (CpMemoryError, asyncio.TimeoutError) as error:
            self.failures += 1
            logger.debug("tokenize for routing failed: %s", error)
            return None
        return engine_blocks(tokens, state.sync.hasher, payload.get("cache_salt"))

    def register_hashes(self, replica: int | None, request_id: str, hashes: Sequence[int], tenant: str) -> None:
        """Register a prompt whose engine block hashes are known (``replica`` None: every replica). No IO."""
        states = self._replicas.values() if replica is None else [self._replicas[replica]] \
            if replica in self._replicas else []
        for state in states:
            state.sync.register_hashes(request_id, hashes, tenant=tenant)

    def register_later(self, replica: int | None, request_id: str, payload: Mapping[str, Any], tenant: str) -> None:
        """Schedule the registration of a prompt sent to ``replica`` (None: every replica; no-op without a sync)."""
        if replica is None:
            for index in list(self._replicas):
                self.register_later(index, request_id, payload, tenant)
            return
        state = self._replicas.get(replica)
        if state is None or not request_id:
            return
        self._background(lambda: self._register(state, request_id, payload, tenant))

    def _background(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``work()`` as a background task, at most ``MAX_PENDING_REGISTRATIONS`` at once (under overload it is
        skipped and counted as a failure: that costs reuse only)."""
        if len(self._pending) >= MAX_PENDING_REGISTRATIONS:
            self.failures += 1
            return
        task = asyncio.create_task(work())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _register(self, state: _Replica, request_id: str, payload: Mapping[str, Any], tenant: str) -> None:
        """Tokenize the prompt as the replica does (``/tokenize``, same model and messages) and register it."""
        try:
            tokens = await self._tokenizer_of(state).tokenize(payload.get("messages") or [],
                                                              model=str(payload.get("model", "")))
            state.sync.register(request_id, tokens, tenant=tenant, cache_salt=payload.get("cache_salt"))
        except CpMemoryError as error:
            self.failures += 1
            logger.debug("registration of %s failed: %s", request_id, error)

    def attribute_later(self, request_id: str, payload: Mapping[str, Any], tenant: str,
                        found: Callable[[int | None], None]) -> None:
        """Behind a gateway: find which replica served a prompt, in the background, and register it there.

        The prompt is tokenized once (the local tokenizer, else the first synced replica's ``/tokenize``); the
        replica whose KV events stored the most of its leading blocks (one, strictly the most) served it: the
        prompt is registered with that replica's eviction sync only and ``found(replica)`` is called. When no
        replica stands out (events not seen, or the prompt is cached on several), the prompt is registered with
        every replica (conservative, as without a view) and ``found(None)`` is called. No-op without a view."""
        if self.view is None or not self._replicas or not request_id:
            return
        self._background(lambda: self._attribute(request_id, payload, tenant, found))

    async def _attribute(self, request_id: str, payload: Mapping[str, Any], tenant: str,
                         found: Callable[[int | None], None]) -> None:
        prompt = await self.prompt_blocks(payload, timeout_s=ATTRIBUTE_TOKENIZE_TIMEOUT_S)
        if prompt is None:
            found(None)
            return
        replica = self.locate(prompt)
        for delay in ATTRIBUTE_RETRY_S:  # the replica's events may trail its answer by a few milliseconds
            if replica is not None:
                break
            await sleep(self.clock, delay)
            replica = self.locate(prompt)
        self.register_hashes(replica, request_id, prompt.keys, tenant)
        found(replica)

    def locate(self, prompt: Any) -> int | None:
        """The replica whose cache holds strictly the most leading blocks of ``prompt`` (engine hashes), or None
        (no view, nothing matched, a tie, or a replica whose events were lost: its view is empty until it resyncs,
        so it could have served the prompt unseen)."""
        if self.view is None or not all(self.view.synced(index) for index in self._replicas):
            return None
        matched = sorted(((self.view.matched_blocks(index, prompt), index) for index in self._replicas), reverse=True)
        if not matched or matched[0][0] == 0 or (len(matched) > 1 and matched[1][0] == matched[0][0]):
            return None
        return matched[0][1]

    def _tokenizer_of(self, state: _Replica) -> Any:
        """The local tokenizer when there is one, else the replica's ``/tokenize``."""
        return self.tokenizer if self.tokenizer is not None else state.client

    def forget(self, request_ids: Sequence[str]) -> None:
        """Stop tracking requests whose leaves were evicted by a report (keeps the sync maps small)."""
        for state in self._replicas.values():
            for request_id in request_ids:
                state.sync.forget(request_id)

    def stats(self) -> dict[int, Any]:
        """The sync counters of each synced replica."""
        return {index: state.sync.stats for index, state in self._replicas.items()}

    async def stop(self) -> None:
        """Cancel pending registrations, stop the subscriber threads, close the clients."""
        for task in list(self._pending):
            task.cancel()
        for state in self._replicas.values():
            await asyncio.to_thread(state.subscriber.stop)
        self._replicas.clear()
        if self._http is not None:
            await self._http.aclose()


@dataclass(frozen=True, slots=True)
class _ConfigOnce:
    """A CacheConfigSource over an already-read config (EvictionSync.for_engine calls it synchronously)."""

    config: Any

    def cache_config(self) -> Any:
        return self.config
