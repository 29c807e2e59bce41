"""What each replica caches, as the router sees it: prompt block keys, prefix views, and the replica score.

A prompt is cut into full blocks; block *i* is named by a key chained over blocks ``0..i`` (so two prompts share key
*i* exactly when they share their first *i+1* blocks). A replica's cached prefix of a prompt is the run of leading
keys its view holds; the router weighs it against load.

Two views implement :class:`PrefixView` (a seam: the shared decision state may give a third, kept in Redis):

* :class:`SentPrefixView` - "what was sent where": every prompt routed to a replica is recorded in that replica's
  LRU of keys, bounded by the replica's cache size in tokens. It needs no engine support and learns nothing about
  real evictions (its bound stands in for them).
* :class:`EventPrefixView` - the engine's truth from vLLM KV events (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``), keyed by the engine's own block hashes (``cpmemory.engines.block_hashes`` reproduces them
  for a prompt's token ids). A replica whose events are out of sequence (a lost batch) or missing (requests that
  should have stored blocks, and no event for ``missing_after_s``) has its view cleared and is *unsynced*: it scores
  by load only until it resyncs (an ``AllBlocksCleared``, or ``resync_after_s`` of in-sequence events after the gap).
  A prompt sent to a replica counts there as *pending* until its blocks are reported stored (or for ``pending_s``):
  the events come only once the engine has prefilled it, and a burst routed before that (many clients at once, a
  released hold) must still follow the first call that carries a prefix instead of scattering as cold.

Both views know a prompt from the moment it is routed (``Dispatcher`` records the decision before the engine
answers): under load the engine accepts a stream at once but prefills it seconds or minutes later, and every call
routed in between would otherwise find nothing of the calls before it.

Scoring (the facts llm-d and SGLang publish, not their code): ``score = prefix_weight * cached_fraction
- queue_weight * in_flight / max_in_flight - kv_weight * kv_utilisation``. llm-d weighs prefix 2 / queue 1 / KV 1;
the router's default queue weight is 0.25 (on the online replays, at 1 the queue term outweighs the small
cached-share differences of prompts that share little and the replicas lose hit rate against a single cache; the
bounded load keeps the balance; docs/decisions.md).
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from cpmemory.engines.block_hashes import BlockHasher
from cpmemory.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

DEFAULT_CHUNK_CHARS = 256
CHARS_PER_TOKEN = 4
SyncState = Literal["synced", "unsynced"]


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """The full blocks of one prompt: chained keys in prompt order and the tokens each block stands for.

    Attributes:
        keys: chained block keys (key *i* names blocks ``0..i``).
        block_tokens: tokens per block (the same for every block of one prompt).
        total_tokens: tokens of the whole prompt (the partial tail included).
    """

    keys: tuple[int, ...]
    block_tokens: int
    total_tokens: int

    def fraction(self, matched_blocks: int) -> float:
        """Share of the prompt's tokens covered by ``matched_blocks`` leading blocks (0..1)."""
        return min(1.0, matched_blocks * self.block_tokens / self.total_tokens) if self.total_tokens else 0.0


def uncached_tokens(prompt: PromptBlocks, matched_blocks: int) -> int:
    """The prompt's tokens a replica whose cache holds its first ``matched_blocks`` blocks must still compute."""
    return max(0, prompt.total_tokens - matched_blocks * prompt.block_tokens)


def content_chars(messages: Sequence[Mapping[str, object]]) -> int:
    """Characters of the messages' contents (content parts as their text form). Pure, O(chars)."""
    return sum(len(str(message.get("content") or "")) for message in messages)


def new_tokens(messages: Sequence[Mapping[str, object]]) -> int:
    """Tokens (at ``CHARS_PER_TOKEN``) of the messages after the last assistant answer: what a conversation's
    replica must compute for its next turn when it still caches the history. Pure, O(chars)."""
    last_answer = max((index for index, message in enumerate(messages) if message.get("role") == "assistant"),
                      default=-1)
    return content_chars(messages[last_answer + 1:]) // CHARS_PER_TOKEN


def _chain(parent: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, key=parent, digest_size=16).digest()


def text_blocks(messages: Sequence[Mapping[str, object]], chunk_chars: int = DEFAULT_CHUNK_CHARS) -> PromptBlocks:
    """Blocks of a chat prompt by characters (the proxy's view when it has no token ids). Pure, O(chars).

    The messages are rendered as ``role NUL content NUL`` one after another, so a prompt that extends another
    (the next turn of a conversation) shares all its full leading chunks. A chunk stands for
    ``chunk_chars / 4`` tokens.
    """
    rendered = "".join(f"{message.get('role', '')}\x00{message.get('content', '')}\x00" for message in messages)
    data = rendered.encode("utf-8", "surrogatepass")
    keys: list[int] = []
    parent = b"cpmemory-prefix"
    for start in range(0, len(data) - chunk_chars + 1, chunk_chars):
        parent = _chain(parent, data[start:start + chunk_chars])
        keys.append(int.from_bytes(parent[:8], "big"))
    block_tokens = max(1, chunk_chars // CHARS_PER_TOKEN)
    return PromptBlocks(tuple(keys), block_tokens, max(1, len(data) // CHARS_PER_TOKEN))


def token_blocks(token_ids: Sequence[int] | np.ndarray, block_size: int) -> PromptBlocks:
    """Blocks of a token sequence (the bench's view: token ids are known). Pure, O(tokens).

    Keys are chained blake2b digests of each block's int64 bytes, not vLLM's hashes (use
    :func:`engine_blocks` to match an engine's KV events).
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    full = len(tokens) // block_size
    data = tokens[: full * block_size].tobytes()
    width = block_size * 8
    keys: list[int] = []
    parent = b"cpmemory-tokens"
    for index in range(full):
        parent = _chain(parent, data[index * width:(index + 1) * width])
        keys.append(int.from_bytes(parent[:8], "big"))
    return PromptBlocks(tuple(keys), block_size, len(tokens))


def engine_blocks(token_ids: Sequence[int], hasher: BlockHasher, cache_salt: str | None = None) -> PromptBlocks:
    """Blocks of a token sequence keyed by the engine's own block hashes, as its KV events name them. O(tokens)."""
    hashes = hasher.hashes(token_ids, cache_salt=cache_salt)
    return PromptBlocks(tuple(hashes), hasher.block_size, len(token_ids))


class PrefixView(Protocol):
    """What the router knows of the replicas' caches. Called from the router's event loop."""

    def matched_blocks(self, replica: int, prompt: PromptBlocks) -> int:
        """Leading blocks of ``prompt`` cached on ``replica`` (0 when unknown or unsynced)."""

    def utilisation(self, replica: int) -> float:
        """Fraction of the replica's cache in use (0..1; 0 when unknown)."""

    def synced(self, replica: int) -> bool:
        """Whether the replica's prefix score can be trusted (False: route it by load only)."""

    def record(self, replica: int, prompt: PromptBlocks) -> None:
        """``prompt`` was sent to ``replica``."""


class SentPrefixView:
    """Per replica, an LRU of the block keys sent there, bounded by the replica's cache size. Not thread-safe.

    Recording a prompt touches its keys tail first, so the head of a prompt is the most recent: eviction takes tails
    before heads (as the engines do), and a surviving key always has its predecessors (prefixes stay matchable).
    Memory: one dict entry per cached block per replica (at most ``capacity_tokens / block tokens``).
    """

    def __init__(self, replicas: int, capacity_tokens: int) -> None:
        """Views of ``replicas`` empty caches of ``capacity_tokens`` tokens each."""
        if replicas < 1 or capacity_tokens < 0:
            raise ValueError("need replicas >= 1 and capacity_tokens >= 0")
        self.capacity_tokens = capacity_tokens
        self._caches: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(replicas)]
        self._used = [0] * replicas

    def matched_blocks(self, replica: int, prompt: PromptBlocks) -> int:
        """Leading keys of ``prompt`` in the replica's LRU. O(matched)."""
        cache = self._caches[replica]
        count = 0
        for key in prompt.keys:
            if key not in cache:
                break
            count += 1
        return count

    def utilisation(self, replica: int) -> float:
        """Tokens recorded / capacity."""
        return min(1.0, self._used[replica] / self.capacity_tokens) if self.capacity_tokens else 1.0

    def synced(self, replica: int) -> bool:
        """Always True: this view is its own truth."""
        return True

    def record(self, replica: int, prompt: PromptBlocks) -> None:
        """Touch the prompt's keys (tail first), then evict least recently used keys down to capacity."""
        cache = self._caches[replica]
        for key in reversed(prompt.keys):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = prompt.block_tokens
                self._used[replica] += prompt.block_tokens
        while self._used[replica] > self.capacity_tokens and cache:
            _, tokens = cache.popitem(last=False)
            self._used[replica] -= tokens

    def clear(self, replica: int) -> None:
        """Forget what ``replica`` holds (its engine restarted or cleared its cache)."""
        self._caches[replica].clear()
        self._used[replica] = 0


@dataclass(slots=True)
class ReplicaSyncStats:
    """Counters of one replica's event view (plain ints, readable from any thread)."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    gaps: int = 0
    missing: int = 0
    resyncs: int = 0


@dataclass(slots=True)
class _EventCache:
    blocks: set[int] = field(default_factory=set)
    state: SyncState = "synced"
    unsynced_since: float | None = None
    awaiting_since: float | None = None  # oldest send that should have produced events, none seen since
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)  # sent, not yet stored: key -> deadline
    stats: ReplicaSyncStats = field(default_factory=ReplicaSyncStats)


PENDING_CACHES = 2
"""Pending blocks a replica's view keeps, in caches' worth (``EventPrefixView.record``)."""


class EventPrefixView:
    """The replicas' caches mirrored from their KV events. Thread-safe (subscriber threads write, the router reads)."""

    def __init__(self, replicas: int, capacity_blocks: Sequence[int | None] | None = None, *,
                 resync_after_s: float = 30.0, missing_after_s: float = 10.0, pending_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
            replicas: number of replicas (index = position in the router).
            capacity_blocks: each replica's cache size in blocks (``vllm:cache_config_info`` num_gpu_blocks), for
                the KV-utilisation term; None where unknown.
            resync_after_s: after a sequence gap, how long in-sequence events must flow before the view is trusted.
            missing_after_s: how long a send that should store blocks may go without any event.
            pending_s: how long a sent prompt's blocks count as cached on its replica before the events report them
                stored (the engine's queue: a call waits there before its prefill); stored or removed, the events
                decide.
            clock: monotonic seconds (tests pass a fake).
        """
        self._caches = [_EventCache() for _ in range(replicas)]
        self._capacity = list(capacity_blocks or [None] * replicas)
        self.resync_after_s = resync_after_s
        self.missing_after_s = missing_after_s
        self.pending_s = pending_s
        self._clock = clock
        self._lock = threading.Lock()

    def handler(self, replica: int) -> _ReplicaHandler:
        """A ``KVEventHandler`` feeding this view for ``replica`` (give it to that replica's subscriber)."""
        return _ReplicaHandler(self, replica)

    def set_capacity(self, replica: int, blocks: int | None) -> None:
        """Record the replica's cache size in blocks (read from the engine after start)."""
        self._capacity[replica] = blocks

    def stats(self, replica: int) -> ReplicaSyncStats:
        """The replica's counters (live object)."""
        return self._caches[replica].stats

    def matched_blocks(self, replica: int, prompt: PromptBlocks) -> int:
        """Leading blocks of ``prompt`` the replica reported stored or was sent and has not stored yet (pending); 0
        while it is unsynced."""
        if not self.synced(replica):
            return 0
        cache = self._caches[replica]
        blocks, pending = cache.blocks, cache.pending
        with self._lock:
            self._expire(cache, self._clock())
            count = 0
            for key in prompt.keys:
                if key not in blocks and key not in pending:
                    break
                count += 1
        return count

    def utilisation(self, replica: int) -> float:
        """Blocks reported stored / the replica's capacity (0 when the capacity is unknown)."""
        capacity = self._capacity[replica]
        return min(1.0, len(self._caches[replica].blocks) / capacity) if capacity else 0.0

    def synced(self, replica: int) -> bool:
        """True unless events were lost or are missing; checks the missing-events deadline and the resync delay."""
        cache, now = self._caches[replica], self._clock()
        with self._lock:
            if cache.state == "synced" and cache.awaiting_since is not None \
                    and now - cache.awaiting_since > self.missing_after_s:
                cache.stats.missing += 1
                self._unsync(cache, now)
            if cache.state == "unsynced" and cache.awaiting_since is None and cache.unsynced_since is not None \
                    and now - cache.unsynced_since >= self.resync_after_s:
                self._resync(cache)
            return cache.state == "synced"

    def record(self, replica: int, prompt: PromptBlocks) -> None:
        """A prompt was sent: the blocks the view lacks are pending until stored (at most ``pending_s``), and events
        must follow within ``missing_after_s``.

        Pending blocks are bounded by ``PENDING_CACHES`` times the replica's capacity (when known), the most
        recently sent kept: a prompt that matches a pending block runs after the prompts queued since that block's,
        which compute their own blocks first; once far more than the cache holds is queued after a block, LRU
        eviction takes it before the new prompt can reuse it. Without the bound a burst of questions
        routed by their first calls' pending prefixes piled most of them onto one replica whose cache held a few.
        Not at one cache's worth: blocks that later prompts hit go back to the end of vLLM's LRU queue and a
        finished prompt's tail is evicted before its head, so shared heads outlive a cache's worth of traffic (bounded
        at one cache, a closed loop cached fewer tokens; docs/decisions.md)."""
        cache = self._caches[replica]
        with self._lock:
            now = self._clock()
            missing = [key for key in prompt.keys if key not in cache.blocks]
            if not missing:
                return
            if cache.awaiting_since is None:
                cache.awaiting_since = now
            if cache.state != "synced":
                return
            deadline = now + self.pending_s
            for key in missing:
                cache.pending[key] = deadline
                cache.pending.move_to_end(key)
            self._expire(cache, now)
            capacity = self._capacity[replica]
            while capacity and len(cache.pending) > PENDING_CACHES * capacity:  # see ``record``
                cache.pending.popitem(last=False)

    @staticmethod
    def _expire(cache: _EventCache, now: float) -> None:
        """Drop pending keys past their deadline (deadlines grow in insertion order). Call with the lock held."""
        pending = cache.pending
        while pending:
            key, deadline = next(iter(pending.items()))
            if deadline > now:
                break
            del pending[key]

    # -- called by the subscriber threads through _ReplicaHandler ---------------------------------------------
    def apply(self, replica: int, batch: EventBatch) -> None:
        """Apply one in-sequence batch."""
        cache = self._caches[replica]
        with self._lock:
            cache.stats.batches += 1
            cache.awaiting_since = None
            for event in batch.events:
                if isinstance(event, BlockStored):
                    cache.blocks.update(event.block_hashes)
                    for key in event.block_hashes:
                        cache.pending.pop(key, None)
                    cache.stats.stored_blocks += len(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    cache.blocks.difference_update(event.block_hashes)
                    cache.stats.removed_blocks += len(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    cache.blocks.clear()
                    cache.pending.clear()
                    cache.stats.clears += 1
                    if cache.state == "unsynced":  # the engine's cache is known again: empty
                        self._resync(cache)

    def gap(self, replica: int) -> None:
        """Batches were lost: clear the view and route the replica by load only until it resyncs."""
        cache = self._caches[replica]
        with self._lock:
            cache.stats.gaps += 1
            self._unsync(cache, self._clock())
            cache.awaiting_since = None

    def _unsync(self, cache: _EventCache, now: float) -> None:
        cache.blocks.clear()
        cache.pending.clear()
        cache.state = "unsynced"
        cache.unsynced_since = now

    @staticmethod
    def _resync(cache: _EventCache) -> None:
        cache.state = "synced"
        cache.unsynced_since = None
        cache.stats.resyncs += 1


@dataclass(frozen=True, slots=True)
class _ReplicaHandler:
    """KVEventHandler of one replica (the subscriber calls it on its thread)."""

    view: EventPrefixView
    replica: int

    def handle_batch(self, batch: EventBatch) -> None:
        self.view.apply(self.replica, batch)

    def handle_gap(self, expected: int, received: int) -> None:
        self.view.gap(self.replica)


@dataclass(frozen=True, slots=True)
class Weights:
    """Weights of the replica score (llm-d's: prefix 2, queue 1, KV utilisation 1; ours: queue 0.25, see above)."""

    prefix: float = 2.0
    queue: float = 0.25
    kv: float = 1.0


def replica_score(weights: Weights, cached_fraction: float, in_flight: int, max_in_flight: int,
                  kv_utilisation: float) -> float:
    """The score of one replica for one prompt (higher is better). Pure."""
    queue = in_flight / max_in_flight if max_in_flight > 0 else 0.0
    return weights.prefix * cached_fraction - weights.queue * queue - weights.kv * kv_utilisation


class TeeHandler:
    """Feeds one subscriber's batches to several handlers (eviction sync and the prefix view)."""

    def __init__(self, *handlers: Any) -> None:
        self.handlers = handlers

    def handle_batch(self, batch: EventBatch) -> None:
        """Pass the batch to every handler (all of them run; the first failure is re-raised after)."""
        self._each(lambda handler: handler.handle_batch(batch))

    def handle_gap(self, expected: int, received: int) -> None:
        """Pass the gap to every handler (all of them run; the first failure is re-raised after)."""
        self._each(lambda handler: handler.handle_gap(expected, received))

    def _each(self, call: Callable[[Any], None]) -> None:
        failure: Exception | None = None
        for handler in self.handlers:
            try:
                call(handler)
            except Exception as error:  # noqa: BLE001 - the subscriber counts it; the other handlers still run
                failure = failure or error
        if failure is not None:
            raise failure
