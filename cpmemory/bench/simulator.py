"""Deterministic token-level prefix-cache simulator (the embedded default engine of the benchmarks).

Two models of the engines' automatic prefix caches:

``mode="radix"`` — SGLang ``RadixCache``:
    a radix tree over token ids whose edges carry token runs. A request matches the longest cached prefix in
    whole pages of ``page_size`` tokens; after the request its page-aligned tokens are inserted (splitting edges
    where it diverges). Capacity is counted in tokens. When the tree holds more than ``capacity_tokens``, whole
    leaves are evicted least-recently-used first (a parent that becomes a leaf is a candidate in turn), exactly as
    ``RadixCache.evict`` pops its heap of leaves keyed by last access time.

``mode="vllm"`` — vLLM v1 automatic prefix caching (``KVCacheManager`` / ``BlockPool``):
    the prompt is cut into full blocks of ``page_size`` tokens (default 16); block *i* is identified by the chained
    hash of block *i-1*'s hash and its own tokens. The hit is the longest run of leading blocks whose hashes are
    cached. The pool holds ``capacity_tokens // page_size`` blocks; a finished request frees its blocks into an LRU
    free queue, tail blocks first (so a request's tail is evicted before its head), and a new block takes the
    least recently freed block, dropping that block's hash.

Both engines recompute at least the last prompt token (SGLang matches ``input_ids[:-1]``; vLLM caps the hit at
``num_tokens - 1``), so a request never hits all of its tokens; the simulator does the same.

Time is a request counter, not a clock, so every run is reproducible. Requests run one at a time (a request's own
tokens are never evicted while it runs, since eviction happens after it is inserted).

Performance: radix edges are numpy int64 arrays compared in one vectorised call per visited node (a node is a
run of tokens shared by a group of requests, so a 5k-token prompt visits tens of nodes, never 5k Python
objects); eviction uses a lazy heap (stale entries are skipped when popped) instead of rescanning the leaves.
The vLLM model digests all full blocks of a prompt in one numpy call (a 64-bit random linear hash of the block's
tokens, wrapping arithmetic) and chains the digests in Python (one tuple hash per block), O(tokens) per request.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cpmemory.errors import InvalidInputError

SimulatorMode = Literal["radix", "vllm"]
SIMULATOR_MODES: tuple[SimulatorMode, ...] = ("radix", "vllm")


def simulator_mode(text: str) -> SimulatorMode:
    """``text`` as a simulator mode (a command-line value).

    Raises:
        InvalidInputError: not ``radix`` or ``vllm``.
    """
    for mode in SIMULATOR_MODES:
        if text == mode:
            return mode
    raise InvalidInputError(f"unknown simulator mode {text!r}; use 'radix' or 'vllm'")
DEFAULT_VLLM_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class SimulatorStats:
    """Counters since construction or the last :meth:`PrefixCacheSimulator.reset`.

    Attributes:
        requests: number of requests run.
        prompt_tokens: tokens of all prompts.
        cached_tokens: prompt tokens served from the cache.
        evicted_tokens: tokens dropped by eviction.
        used_tokens: tokens held by the cache now.
        peak_tokens: most tokens held at once (after eviction).
    """

    requests: int
    prompt_tokens: int
    cached_tokens: int
    evicted_tokens: int
    used_tokens: int
    peak_tokens: int

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (0.0 before any request)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens that had to be computed."""
        return self.prompt_tokens - self.cached_tokens


class _RadixNode:
    """One radix-tree node: the token run on the edge from its parent, its children and last access tick."""

    __slots__ = ("alive", "children", "key", "parent", "tick")

    def __init__(self, key: np.ndarray, parent: _RadixNode | None, tick: int) -> None:
        self.key = key
        self.children: dict[object, _RadixNode] = {}
        self.parent = parent
        self.tick = tick
        self.alive = True


def _common_length(edge: np.ndarray, tokens: np.ndarray, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[start:]`` (one vectorised comparison)."""
    length = min(len(edge), len(tokens) - start)
    unequal = np.flatnonzero(edge[:length] != tokens[start : start + length])
    return int(unequal[0]) if len(unequal) else length


class _RadixCache:
    """SGLang-style radix cache (see the module docstring). Mutated by :meth:`run`."""

    def __init__(self, capacity_tokens: int, page_size: int) -> None:
        self.capacity = capacity_tokens
        self.page = page_size
        self.root = _RadixNode(np.empty(0, dtype=np.int64), None, 0)
        self.used = 0
        self.evicted = 0
        self.tick = 0
        self.heap: list[tuple[int, int, _RadixNode]] = []
        self.sequence = itertools.count()  # heap tie-break: insertion order, deterministic

    def _child_key(self, tokens: np.ndarray, start: int) -> object:
        if self.page == 1:
            return int(tokens[start])
        return tokens[start : start + self.page].tobytes()

    def _touch(self, node: _RadixNode) -> None:
        node.tick = self.tick
        heapq.heappush(self.heap, (self.tick, next(self.sequence), node))

    def _split(self, child: _RadixNode, length: int) -> _RadixNode:
        """Split ``child``'s edge after ``length`` tokens; return the new middle node."""
        parent = child.parent
        assert parent is not None
        middle = _RadixNode(child.key[:length], parent, child.tick)
        parent.children[self._child_key(child.key, 0)] = middle
        child.key = child.key[length:]
        child.parent = middle
        middle.children[self._child_key(child.key, 0)] = child
        return middle

    def run(self, tokens: np.ndarray) -> int:
        """Match then insert one request; return its cached tokens. Evicts down to capacity afterwards."""
        self.tick += 1
        aligned = len(tokens) - len(tokens) % self.page
        node, position, matched = self.root, 0, -1
        while position < aligned:
            child = node.children.get(self._child_key(tokens, position))
            if child is None:
                matched = position if matched < 0 else matched
                leaf = _RadixNode(tokens[position:aligned].copy(), node, self.tick)
                node.children[self._child_key(tokens, position)] = leaf
                self.used += aligned - position
                self._touch(leaf)
                break
            common = _common_length(child.key, tokens[:aligned], position)
            common -= common % self.page
            if common < len(child.key):
                matched = position + common if matched < 0 else matched
                child = self._split(child, common)
            self._touch(child)
            node, position = child, position + common
        matched = position if matched < 0 else matched
        self._evict()
        limit = len(tokens) - 1
        return min(matched, limit - limit % self.page) if limit > 0 else 0

    def peek(self, tokens: np.ndarray) -> int:
        """The cached tokens ``run`` would report now, without changing anything. Pure; O(tokens)."""
        aligned = len(tokens) - len(tokens) % self.page
        node, position = self.root, 0
        while position < aligned:
            child = node.children.get(self._child_key(tokens, position))
            if child is None:
                break
            common = _common_length(child.key, tokens[:aligned], position)
            common -= common % self.page
            position += common
            if common < len(child.key):
                break
            node = child
        limit = len(tokens) - 1
        return min(position, limit - limit % self.page) if limit > 0 else 0

    def _evict(self) -> None:
        """Pop least-recently-used leaves until the tree holds at most ``capacity`` tokens."""
        while self.used > self.capacity and self.heap:
            tick, _, node = heapq.heappop(self.heap)
            if not node.alive or node.children or tick != node.tick or node is self.root:
                continue  # stale entry: the node was touched again, gained children, or is gone
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key, 0)]
            node.alive = False
            self.used -= len(node.key)
            self.evicted += len(node.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(self.heap, (parent.tick, next(self.sequence), parent))
        if len(self.heap) > 8 * 1024 and len(self.heap) > 4 * self._count_nodes():
            self._compact_heap()

    def _count_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    def _compact_heap(self) -> None:
        """Rebuild the heap from the current leaves (drops stale entries). O(nodes)."""
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append((node.tick, next(self.sequence), node))
        heapq.heapify(leaves)
        self.heap = leaves


class _VllmCache:
    """vLLM-style block pool with chained block hashes (see the module docstring). Mutated by :meth:`run`."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.cached: dict[int, None] = {}  # block hash -> cached (the block id is irrelevant to hit rates)
        self.free: OrderedDict[int, None] = OrderedDict()  # cached blocks with no running request, LRU first
        self.evicted = 0
        # odd 64-bit weights from a fixed seed: the block digest is deterministic across runs and machines
        self.weights = (
            np.random.default_rng(0x5EED).integers(0, 1 << 63, size=block_size, dtype=np.uint64) | 1
        )

    @property
    def used(self) -> int:
        return len(self.cached) * self.block_size

    def _hashes(self, tokens: np.ndarray) -> list[int]:
        """Chained hashes of the full blocks: hash(parent hash, digest of this block's tokens)."""
        full = len(tokens) // self.block_size
        blocks = tokens[: full * self.block_size].astype(np.uint64).reshape(full, self.block_size)
        with np.errstate(over="ignore"):
            digests = (blocks * self.weights).sum(axis=1, dtype=np.uint64).tolist()
        parent, out = 0, []
        for digest in digests:
            parent = hash((parent, digest))
            out.append(parent)
        return out

    def _allocate(self, block_hash: int) -> bool:
        """Cache one new block, evicting the least recently freed block if the pool is full."""
        if len(self.cached) >= self.num_blocks:
            if not self.free:
                return False  # every block is held by this request: the rest is computed but not cached
            victim, _ = self.free.popitem(last=False)
            del self.cached[victim]
            self.evicted += self.block_size
        self.cached[block_hash] = None
        return True

    def peek(self, tokens: np.ndarray) -> int:
        """The cached tokens ``run`` would report now, without changing anything. Pure; O(tokens)."""
        hashes = self._hashes(tokens)
        limit = min(len(hashes), (len(tokens) - 1) // self.block_size)
        hits = 0
        while hits < limit and hashes[hits] in self.cached:
            hits += 1
        return hits * self.block_size

    def run(self, tokens: np.ndarray) -> int:
        """Match then cache one request's full blocks; return its cached tokens."""
        hashes = self._hashes(tokens)
        limit = (len(tokens) - 1) // self.block_size
        hits = 0
        while hits < min(len(hashes), limit) and hashes[hits] in self.cached:
            hits += 1
        held: list[int] = []
        for block_hash in hashes:
            if block_hash in self.cached:
                self.free.pop(block_hash, None)  # held by the running request: not evictable
            elif not self._allocate(block_hash):
                break
            held.append(block_hash)
        for block_hash in reversed(held):  # vLLM frees in reverse so that tail blocks are evicted first
            self.free[block_hash] = None
        return hits * self.block_size


class PrefixCacheSimulator:
    """Token-level prefix-cache simulator of SGLang RadixCache (``"radix"``) or vLLM APC (``"vllm"``).

    Example:
        >>> sim = PrefixCacheSimulator(1000)
        >>> sim.run([1, 2, 3, 4]), sim.run([1, 2, 3, 9])
        (0, 3)
    """

    def __init__(
        self, capacity_tokens: int, *, mode: SimulatorMode = "radix", page_size: int | None = None
    ) -> None:
        """Create an empty cache.

        Args:
            capacity_tokens: cache size in tokens (vLLM: rounded down to whole blocks).
            mode: ``"radix"`` (SGLang) or ``"vllm"``.
            page_size: radix page size (default 1) or vLLM block size (default 16), in tokens.

        Raises:
            InvalidInputError: on a negative capacity, a page size below 1 or an unknown mode.
        """
        if mode not in ("radix", "vllm"):
            raise InvalidInputError(f"unknown simulator mode {mode!r}; use 'radix' or 'vllm'")
        if page_size is None:
            page_size = 1 if mode == "radix" else DEFAULT_VLLM_BLOCK_SIZE
        if capacity_tokens < 0 or page_size < 1:
            raise InvalidInputError(
                f"need capacity_tokens >= 0 and page_size >= 1, got {capacity_tokens}, {page_size}"
            )
        self.capacity_tokens = int(capacity_tokens)
        self.mode: SimulatorMode = mode
        self.page_size = int(page_size)
        self.reset()

    def reset(self) -> None:
        """Empty the cache and zero the counters."""
        if self.mode == "radix":
            self._cache: _RadixCache | _VllmCache = _RadixCache(self.capacity_tokens, self.page_size)
        else:
            self._cache = _VllmCache(self.capacity_tokens, self.page_size)
        self._requests = self._prompt_tokens = self._cached_tokens = self._peak = 0

    def run(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Serve one request: return how many of its leading tokens were cached, then cache its tokens.

        Mutates the cache (insert, LRU update, eviction). O(tokens) for vLLM; for radix, O(tokens) numpy work plus
        O(visited nodes) Python work.
        """
        cached = self._cache.run(np.asarray(tokens, dtype=np.int64))
        self._requests += 1
        self._prompt_tokens += len(tokens)
        self._cached_tokens += cached
        self._peak = max(self._peak, self._cache.used)
        return cached

    def peek(self, tokens: Sequence[int] | np.ndarray) -> int:
        """How many leading tokens of ``tokens`` are cached now (what the engine's longest-prefix-match scheduler
        sees). Pure: no insert, no LRU update, no counter."""
        return self._cache.peek(np.asarray(tokens, dtype=np.int64))

    @property
    def used_tokens(self) -> int:
        """Tokens the cache holds now."""
        return self._cache.used

    @property
    def stats(self) -> SimulatorStats:
        """A snapshot of the counters."""
        return SimulatorStats(
            requests=self._requests,
            prompt_tokens=self._prompt_tokens,
            cached_tokens=self._cached_tokens,
            evicted_tokens=self._cache.evicted,
            used_tokens=self._cache.used,
            peak_tokens=self._peak,
        )
