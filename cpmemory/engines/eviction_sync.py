"""Keep the context index in step with what the engine evicts, from KV events or eviction reports.

The engine's events carry block hashes, never request ids. :class:`EvictionSync` bridges the two:

1. When cpmemory sends a request, :meth:`EvictionSync.register` receives the prompt's token ids (from the
   engine's ``/tokenize``, chat template applied) and computes the prompt's chained block hashes offline
   (:class:`~cpmemory.engines.block_hashes.BlockHasher`). It keeps ``hash -> request ids`` and
   ``request id -> (tenant, hashes)``.
2. ``BlockRemoved``: every request whose prompt needed a removed block has lost (part of) its cached prefix, so
   its index leaf is evicted through ``target.evict(request_ids, tenant=...)`` and the request is forgotten.
3. ``AllBlocksCleared`` resets everything (``target.reset_index()``); so does a sequence gap, so that a lost
   batch can never leave a silently wrong index (the price is a cold index, which only costs reuse).
4. ``BlockStored`` events are used as a cross-check and a fallback: for every stored block the sync computes its
   own hash from the event's token ids (and cache salt) and the parent it already knows. When the server's hash
   differs from ours (another ``PYTHONHASHSEED``, another algorithm) the server's hash is translated to ours, so
   removals still find their requests. ``hash_matches`` / ``hash_mismatches`` count how often the offline
   reproduction agreed with the server.

Eviction reports from engines patched to name request ids go through :meth:`EvictionSync.report_evicted`
(the proxy's HTTP endpoint calls it).

All public methods are thread-safe (one lock): the subscriber thread applies events while request handlers
register prompts. The target is called outside the lock so that a slow store cannot stall registrations.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cpmemory.engines.block_hashes import SUPPORTED_ALGORITHMS, BlockHasher, external_hash
from cpmemory.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"


class PromptTokenizer(Protocol):
    """Anything that tokenizes chat messages as the engine does (``EngineClient`` satisfies it)."""

    def tokenize(self, messages: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` with the chat template and generation prompt applied."""


class CacheConfigSource(Protocol):
    """Anything that reports the engine's KV-cache configuration (``EngineClient`` satisfies it)."""

    def cache_config(self) -> Any:
        """An object with ``block_size`` and ``hash_algorithm``."""


class IndexEvictor(Protocol):
    """What the sync needs from the facade (``CpMemory`` satisfies it)."""

    def evict(self, request_ids: Sequence[str], *, tenant: str = DEFAULT_TENANT) -> int:
        """Remove the leaves of ``request_ids`` from the tenant's index; return how many were removed."""

    def reset_index(self, tenant: str | None = None) -> None:
        """Drop the index of one tenant, or of all tenants when ``tenant`` is None."""


@dataclass(slots=True)
class SyncStats:
    """Counters (plain ints, readable from any thread)."""

    registered: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    unknown_removed_blocks: int = 0
    hash_matches: int = 0
    hash_mismatches: int = 0
    evicted_requests: int = 0
    evicted_leaves: int = 0
    resets: int = 0
    resyncs: int = 0
    reported_requests: int = 0
    target_errors: int = 0
    dropped_registrations: int = 0


@dataclass(frozen=True, slots=True)
class _Registration:
    tenant: str
    hashes: tuple[int, ...]


class EvictionSync:
    """Maps engine block hashes to request ids and evicts the matching index leaves. Implements KVEventHandler."""

    def __init__(self, target: IndexEvictor, hasher: BlockHasher, *,
                 max_tracked_requests: int = 1_000_000) -> None:
        """Args:
            target: the facade (or anything with ``evict`` and ``reset_index``).
            hasher: the engine's block hashing (block size from ``/metrics``).
            max_tracked_requests: bound on the mapping; past it the oldest registration is forgotten (its leaf
                is then left to the facade's own ``max_leaves_per_tenant`` bound).
        """
        if max_tracked_requests < 1:
            raise ValueError("max_tracked_requests must be >= 1")
        self.target = target
        self.hasher = hasher
        self.max_tracked_requests = max_tracked_requests
        self.stats = SyncStats()
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, _Registration] = OrderedDict()
        self._owners: dict[int, set[str]] = defaultdict(set)
        self._translation: dict[int, int] = {}
        # our 64-bit hash -> our full digest, for every block the engine reported stored: chaining the next
        # stored block needs the parent's full digest, the event only carries 64 bits of it.
        self._digest_of: dict[int, bytes] = {}

    @classmethod
    def for_engine(cls, target: IndexEvictor, engine: CacheConfigSource) -> EvictionSync:
        """Build a sync whose hasher follows the engine's block size and hash algorithm (one ``/metrics`` call).

        An algorithm we cannot reproduce (``xxhash``: seeded per process) falls back to ``sha256``: every server
        hash then goes through the ``BlockStored`` translation (``stats.hash_mismatches``), which still maps
        removals to requests as long as the sync saw the blocks being stored.
        """
        config = engine.cache_config()
        algorithm: Any = config.hash_algorithm if config.hash_algorithm in SUPPORTED_ALGORITHMS else "sha256"
        if algorithm != config.hash_algorithm:
            logger.warning("engine hashes blocks with %s; matching through BlockStored token ids",
                           config.hash_algorithm)
        return cls(target, BlockHasher(config.block_size, algorithm))

    # -- registration -------------------------------------------------------------------------------------
    def register(self, request_id: str, token_ids: Sequence[int], *, tenant: str = DEFAULT_TENANT,
                 cache_salt: str | None = None) -> tuple[int, ...]:
        """Record the prompt of ``request_id`` (its token ids as the engine sees them). O(tokens).

        Registering the same id again replaces its previous prompt. Returns the prompt's block hashes
        (only full blocks are cached, so a prompt shorter than one block registers nothing).
        """
        hashes = tuple(self.hasher.hashes(token_ids, cache_salt=cache_salt))
        self.register_hashes(request_id, hashes, tenant=tenant)
        return hashes

    def register_messages(self, tokenizer: PromptTokenizer, request_id: str,
                          messages: Sequence[Mapping[str, Any]], *, tenant: str = DEFAULT_TENANT,
                          cache_salt: str | None = None) -> tuple[int, ...]:
        """Tokenize ``messages`` through the engine (``/tokenize``) and register them. One HTTP call.

        Raises:
            EngineError: the engine could not tokenize (nothing is registered).
        """
        return self.register(request_id, tokenizer.tokenize(messages), tenant=tenant, cache_salt=cache_salt)

    def register_hashes(self, request_id: str, hashes: Iterable[int], *, tenant: str = DEFAULT_TENANT) -> None:
        """Record ``request_id`` as needing the given block hashes (already in the 64-bit event form)."""
        registration = _Registration(tenant=tenant, hashes=tuple(hashes))
        with self._lock:
            self._forget_locked(request_id)
            self._requests[request_id] = registration
            for block_hash in registration.hashes:
                self._owners[block_hash].add(request_id)
            self.stats.registered += 1
            while len(self._requests) > self.max_tracked_requests:
                self._forget_locked(next(iter(self._requests)))
                self.stats.dropped_registrations += 1

    def forget(self, request_id: str) -> bool:
        """Stop tracking ``request_id`` (e.g. its leaf was evicted by other means). Returns whether it was known."""
        with self._lock:
            return self._forget_locked(request_id)

    def tracked_requests(self) -> int:
        """How many requests are tracked."""
        with self._lock:
            return len(self._requests)

    def requests_for(self, block_hash: int) -> set[str]:
        """Request ids whose prompt contains ``block_hash`` (event form). A copy."""
        with self._lock:
            return set(self._owners.get(self._translation.get(block_hash, block_hash), ()))

    # -- KVEventHandler -------------------------------------------------------------------------------------
    def handle_batch(self, batch: EventBatch) -> None:
        """Apply a batch in order: stores update the translation, removals evict, a clear resets."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._apply_stored(event)
            elif isinstance(event, BlockRemoved):
                self._apply_removed(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.reset(reason="AllBlocksCleared")

    def handle_gap(self, expected: int, received: int) -> None:
        """A batch was lost: forget every mapping and reset the index (never keep a silently wrong index)."""
        logger.warning("KV events %d..%d lost; resetting the index", expected, received - 1)
        with self._lock:
            self.stats.resyncs += 1
        self.reset(reason="sequence gap")

    # -- direct calls ---------------------------------------------------------------------------------------
    def report_evicted(self, request_ids: Sequence[str], *, tenant: str | None = None) -> int:
        """An engine reported these requests' prefixes evicted: evict their leaves. Returns leaves removed.

        Args:
            request_ids: ids as sent with the requests.
            tenant: the tenant of ids this sync never registered (default tenant when None); registered ids
                use the tenant they were registered with.
        """
        with self._lock:
            self.stats.reported_requests += len(request_ids)
            by_tenant: dict[str, list[str]] = defaultdict(list)
            for request_id in request_ids:
                registration = self._requests.get(request_id)
                owner = registration.tenant if registration else (tenant or DEFAULT_TENANT)
                by_tenant[owner].append(request_id)
                self._forget_locked(request_id)
        return self._evict(by_tenant)

    def reset(self, *, reason: str = "reset") -> None:
        """Forget all mappings and reset every tenant's index."""
        with self._lock:
            self._requests.clear()
            self._owners.clear()
            self._translation.clear()
            self._digest_of.clear()
            self.stats.resets += 1
        logger.info("eviction sync reset (%s)", reason)
        try:
            self.target.reset_index(None)
        except Exception:
            self.stats.target_errors += 1
            logger.exception("reset_index failed")

    # -- internals ------------------------------------------------------------------------------------------
    def _forget_locked(self, request_id: str) -> bool:
        registration = self._requests.pop(request_id, None)
        if registration is None:
            return False
        for block_hash in registration.hashes:
            owners = self._owners.get(block_hash)
            if owners is not None:
                owners.discard(request_id)
                if not owners:
                    del self._owners[block_hash]
        return True

    def _apply_stored(self, event: BlockStored) -> None:
        """Compute our own hash of each stored block; translate the server's hash when it differs.

        A block whose parent we never saw stored (the subscriber joined late) cannot be reproduced; it and the
        rest of its event are assumed to hash as we would (the common case: exact reproduction).
        """
        with self._lock:
            self.stats.stored_blocks += len(event.block_hashes)
            if event.block_size != self.hasher.block_size:
                return
            parent_digest: bytes | None = None
            if event.parent_block_hash is not None:
                parent_ours = self._translation.get(event.parent_block_hash, event.parent_block_hash)
                parent_digest = self._digest_of.get(parent_ours)
                if parent_digest is None:
                    return
            for index, server_hash in enumerate(event.block_hashes):
                start = index * event.block_size
                tokens = event.token_ids[start:start + event.block_size]
                if len(tokens) != event.block_size:
                    return
                salt = self._cache_salt(event, index) if parent_digest is None else None
                parent_digest = self.hasher.chain(parent_digest, tokens, cache_salt=salt)
                ours = external_hash(parent_digest)
                self._digest_of[ours] = parent_digest
                if ours == server_hash:
                    self.stats.hash_matches += 1
                else:
                    self.stats.hash_mismatches += 1
                    self._translation[server_hash] = ours

    @staticmethod
    def _cache_salt(event: BlockStored, index: int) -> str | None:
        """The cache salt of a chain's first block, published untagged in its extra keys."""
        if not event.extra_keys or index >= len(event.extra_keys):
            return None
        keys = event.extra_keys[index]
        if isinstance(keys, (list, tuple)):
            strings = [key for key in keys if isinstance(key, str)]
            return strings[-1] if strings else None
        return None

    def _apply_removed(self, hashes: Sequence[int]) -> None:
        by_tenant: dict[str, list[str]] = defaultdict(list)
        with self._lock:
            for server_hash in hashes:
                ours = self._translation.pop(server_hash, server_hash)
                self._digest_of.pop(ours, None)
                self.stats.removed_blocks += 1
                owners = self._owners.get(ours)
                if not owners:
                    self.stats.unknown_removed_blocks += 1
                    continue
                for request_id in list(owners):
                    registration = self._requests[request_id]
                    by_tenant[registration.tenant].append(request_id)
                    self._forget_locked(request_id)
        self._evict(by_tenant)

    def _evict(self, by_tenant: dict[str, list[str]]) -> int:
        removed = 0
        for tenant, request_ids in by_tenant.items():
            try:
                leaves = self.target.evict(request_ids, tenant=tenant)
            except Exception:
                self.stats.target_errors += 1
                logger.exception("evict failed for tenant %s", tenant)
                continue
            removed += int(leaves or 0)
            self.stats.evicted_requests += len(request_ids)
            self.stats.evicted_leaves += int(leaves or 0)
        return removed
