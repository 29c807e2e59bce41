"""A tenant's shared decision state in Redis: the online orderer (``cpmemory.core.online``) run by ``decide.lua``.

When the facade's store is Redis, what decides block orders lives there, under the store's prefix and one hash tag
per tenant (``P:{T}:ord3:*``, see :meth:`cpmemory.stores.keys.KeyScheme.decision_keys`): K facades on one Redis and
prefix decide as one, and a restarted process resumes. The calls ride in the same round trip as the session state:
``reserve`` pipelines the ``order`` call (observe + match), ``commit`` pipelines the ``record`` call (the order
sent and its request id), so a request costs 2 round trips in all. The script returns the matched path and the
request's counts and postings; the rest of the order (the co-occurrence extension) is computed here by the
orderer's own code (:meth:`cpmemory.core.online.OnlineOrderer._extension`), so Lua mirrors only the trie, once
dedup has said which blocks the prompt shows (:class:`SharedOrder`). A later turn (its prompt opens with its own
history: ``ReserveRequest.match_prefix`` False) is observed but not matched (a match budget of 0).

Blocks travel as 8-byte keys (:func:`block_key`, a blake2b digest of the caller's key) and each trie node is one
hash field of 14 bytes (its parent's 6-byte id and its block) holding 16 bytes (its id, count, last use): the
script builds a child's field by concatenation (no hashing in Lua) and reads a node in one field. Bounded per
tenant: ``max_requests`` recorded orders (the oldest forgotten first; at most k trie nodes and 8 bytes per block
each), ``max_blocks`` counted blocks (beyond, the counts and postings restart; a block's posting keeps the last
``posting_length`` requests that retrieved it, 6 bytes each), and the conversation TTL on every key.

After a gap (this process's calls to Redis failed, or the engine's cache was cleared) the shared trie is not
trusted: :class:`GapTracker` makes the next decision call of each tenant say so, and the script then ignores every
node last used before that moment (the retrieval counts are kept: they describe the workload, not the cache).
Sans-IO: this module builds calls and decodes replies.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from cpmemory.stores.keys import KeyScheme
from cpmemory.stores.redis_codec import ScriptCall

DECISION_SCRIPT = "decide"
BLOCK_KEY_BYTES = 8
RESET = "reset"
MAX_TRACKED_TENANTS = 65_536


@dataclass(frozen=True, slots=True)
class DecisionLimits:
    """Bounds of one tenant's shared decision state."""

    max_requests: int = 100_000
    max_blocks: int = 200_000
    ttl_ms: int = 0
    match_budget: int = 64  # = cpmemory.core.online.MATCH_BUDGET (a test keeps them equal)
    recency_scale: float = 50.0  # = cpmemory.core.online.RECENCY_SCALE
    posting_length: int = 16  # = cpmemory.core.online.POSTING_LENGTH
    fanout: int = 128  # children a trie node keeps in one field (beyond, one field each)


@functools.lru_cache(maxsize=65_536)
def block_key(key: str) -> bytes:
    """The 8-byte key a block travels and is stored under in the decision state (blake2b of the caller's key).
    Pure; cached (content hashes recur)."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=BLOCK_KEY_BYTES,
                           person=b"cpm-block").digest()


@dataclass(frozen=True, slots=True)
class OrderCall:
    """An ``order`` script call and what turns its reply into a :class:`SharedOrder` (8-byte keys -> the caller's
    keys)."""

    call: ScriptCall
    keys_of: dict[bytes, str]
    sizes: tuple[float, ...]

    def parse(self, reply: Sequence[Any]) -> SharedOrder:
        """The matched path and each block's counts (decoding only: the extension runs in :meth:`SharedOrder.order`).
        """
        keys_of = self.keys_of
        own, path_blocks = int(reply[0]), bytes(reply[1])
        path = tuple(keys_of[path_blocks[at : at + 8]] for at in range(0, len(path_blocks), 8))
        return SharedOrder(path, dict(zip(keys_of.values(), reply[2:])), dict(zip(keys_of.values(), self.sizes)), own)

    def decided(self, reply: Sequence[Any]) -> list[str]:
        """The order of every block of the call (its distinct keys)."""
        return self.parse(reply).order(list(self.keys_of.values()))


@dataclass(frozen=True, slots=True)
class SharedOrder:
    """The shared decision state's answer for one request: the matched path and each block's packed freq value
    after the request was observed (count, first ordinal, posting; ``decide.lua``), with its size.

    :meth:`order` completes the order of the blocks the prompt shows in full (known once dedup has run, after the
    round trip): the extension, ``O(k^2 * posting)``, then runs on those k blocks only, as the in-memory orderer
    does (a later turn shows about a third of its blocks).
    """

    path: tuple[str, ...]
    values: dict[str, bytes]
    sizes: dict[str, float]
    own: int

    def order(self, keys: Sequence[str]) -> list[str]:
        """``keys`` (distinct, relevance order) in the order to send: the matched path's blocks among them, then the
        others in the online orderer's extension order (:func:`extend_order`). Pure."""
        wanted = set(keys)
        path = [key for key in self.path if key in wanted]
        sizes = self.sizes
        return extend_order(keys, [sizes.get(key, 1.0) for key in keys], path, self.values, self.own)


def extend_order(keys: Sequence[str], sizes: Sequence[float], path: Sequence[str], values: dict[str, bytes],
                 own: int) -> list[str]:
    """``path`` then the other ``keys`` in the online orderer's extension order, from each key's packed freq value
    in ``values`` (a key without one: never retrieved). Runs ``OnlineOrderer._extension`` itself on an orderer
    holding just these counts, so the rule is the Python one. Pure; O(k^2 * posting)."""
    from collections import Counter

    from cpmemory.core.online import OnlineOrderer

    frequency: Counter[Hashable] = Counter()
    first: dict[Hashable, int] = {}
    postings: dict[Hashable, tuple[int, ...]] = {}
    unpack, from_bytes = struct.unpack, int.from_bytes
    for key in keys:
        value = values.get(key)
        if value is None:
            continue
        frequency[key] = from_bytes(value[:6], "big")
        first[key] = from_bytes(value[6:12], "big")
        postings[key] = unpack(f">{(len(value) - 12) // 4}I", value[12:])  # ordinals modulo 2^32
    view = OnlineOrderer()
    view._frequency, view._first_seen, view._requests_seen = frequency, first, own
    view._postings = postings  # type: ignore[assignment] # read only: tuples serve as the lists do
    placed = set(path)
    size: dict[Hashable, float] = dict(zip(keys, sizes))
    rest: list[Hashable] = [key for key in keys if key not in placed]
    return list(path) + [str(key) for key in view._extension(rest, size, path, own % 2**32)]


class DecisionCodec:
    """Builds ``decide.lua`` calls (script name, KEYS, ARGV) and decodes their replies. Pure."""

    __slots__ = ("_head", "_tenant_keys", "keys", "limits")

    def __init__(self, keys: KeyScheme, limits: DecisionLimits) -> None:
        self.keys = keys
        self.limits = limits
        self._head = (limits.ttl_ms, limits.max_requests, limits.max_blocks)
        self._tenant_keys = functools.lru_cache(maxsize=4096)(keys.decision_keys)  # a digest per call otherwise

    def _args(self, mode: str, request_id: str, gap: str, match: bool = True) -> tuple[object, ...]:
        limits = self.limits
        return (mode, *self._head, request_id, limits.match_budget if match else 0, repr(limits.recency_scale), gap,
                limits.fanout, limits.posting_length)

    def order_call(self, tenant: str, hashes: Sequence[str], sizes: Sequence[float], gap: str = "",
                   match: bool = True) -> OrderCall:
        """Observe and match a request's distinct ``hashes`` (``OrderCall.parse`` then ``SharedOrder.order``
        complete the order).

        ``match=False`` (``ReserveRequest.match_prefix``: a later turn) observes only: a match budget of 0, so the
        script walks no trie node and the order is the extension alone.

        The blocks travel concatenated, with their sizes and their ranks among the request's keys in string order
        (the match breaks ties by the key, as the Python orderer does) packed as binary structs: the script then
        parses three arguments, not three per block. Keys whose 8-byte keys collide keep the first.
        """
        keys_of: dict[bytes, str] = {}
        kept: list[float] = []
        for digest, size in zip(hashes, sizes):
            compact = block_key(digest)
            if compact not in keys_of:
                keys_of[compact] = digest
                kept.append(size)
        blocks = b"".join(keys_of)
        packed_sizes = ranks = b""  # only the match reads them
        if match:
            compacts = list(keys_of)
            rank = dict.fromkeys(compacts, 0)
            for position, compact in enumerate(sorted(compacts, key=keys_of.__getitem__)):
                rank[compact] = position
            packed_sizes = struct.pack(f">{len(compacts)}d", *kept)
            ranks = struct.pack(f">{len(compacts)}I", *rank.values())
        args = (*self._args("order", "", gap, match), blocks, packed_sizes, ranks)
        return OrderCall(ScriptCall(DECISION_SCRIPT, self._tenant_keys(tenant), args), keys_of, tuple(kept))

    def record_call(self, tenant: str, order: Sequence[str], request_id: str, gap: str = "") -> ScriptCall:
        """Record that ``order`` was sent as ``request_id``."""
        blocks = b"".join(dict.fromkeys(block_key(key) for key in order))
        return ScriptCall(DECISION_SCRIPT, self._tenant_keys(tenant),
                          (*self._args("record", request_id, gap), blocks))

    def evict_call(self, tenant: str, request_ids: Sequence[str], gap: str = "") -> ScriptCall:
        """Take evicted requests' weight off their paths (with ``gap`` = :data:`RESET` and no ids: distrust the
        whole trie, the engine's cache was cleared)."""
        return ScriptCall(DECISION_SCRIPT, self._tenant_keys(tenant), (*self._args("evict", "", gap),
                                                                           *request_ids))


class GapTracker:
    """What a store tells the shared decision state after a gap (sans-IO; thread-safe).

    A gap is a failed call to Redis (this process then serves pass-through: prompts reach the engine unrecorded,
    evictions are lost) or a cleared engine cache (:meth:`distrust`). After one, the next decision call of each
    tenant carries :meth:`argument`: the milliseconds since this process's last failure. The script then distrusts
    the tenant's trie unless a gap was already taken there since that failure (less a slack): K workers that saw
    one outage distrust once, and a worker that comes back late does not throw away what others recorded after
    it. :data:`RESET` distrusts at once (one tenant's engine cache was cleared). Tenants reported since the last
    failure are remembered up to ``MAX_TRACKED_TENANTS`` (then forgotten: a tenant reported twice is distrusted
    once, the script deduplicates by time).
    """

    __slots__ = ("_clock", "_failed_at", "_lock", "_reported", "_resets")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the monotonic time in seconds (a stepped one in tests)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._failed_at: float | None = None  # monotonic time of the last failure (None: never)
        self._reported: set[str] = set()
        self._resets: set[str] = set()

    def failed(self) -> None:
        """A call to Redis failed: every tenant's next decision call reports it. O(1)."""
        with self._lock:
            self._failed_at = self._clock()
            self._reported.clear()

    def distrust(self, tenant: str | None = None) -> None:
        """The engine's cache was cleared (for ``tenant``, or for every tenant): its next decision call distrusts
        what the shared state holds. No IO."""
        if tenant is None:
            self.failed()
            return
        with self._lock:
            self._resets.add(tenant)

    def argument(self, tenant: str) -> str:
        """The ``gap`` argument of the tenant's next decision call ("" nothing to report). Pure (see
        :meth:`reported`); O(1), and lock-free when there never was a gap (the hot path)."""
        if self._failed_at is None and not self._resets:
            return ""
        with self._lock:
            if tenant in self._resets:
                return RESET
            if self._failed_at is None or tenant in self._reported:
                return ""
            return str(max(0, round((self._clock() - self._failed_at) * 1000)))

    def reported(self, tenant: str, argument: str) -> None:
        """The decision call carrying ``argument`` succeeded: the tenant knows about the gap."""
        if not argument:
            return
        with self._lock:
            if argument == RESET:
                self._resets.discard(tenant)
            if len(self._reported) >= MAX_TRACKED_TENANTS:
                self._reported.clear()
            self._reported.add(tenant)


_RECORD_BYTES = 24  # a child in a narrow node: block (8 bytes) .. ENTRY (decide.lua: '>I6I4I6', 16 bytes)


def _entry(value: bytes) -> tuple[bytes, int]:
    """(node id, count) of an ENTRY."""
    return value[:6], int.from_bytes(value[6:10], "big")


def check_trie(trie: dict[bytes, bytes], paths: dict[bytes, bytes], fifo: Sequence[bytes]) -> None:
    """Check one tenant's decision state (the raw ``trie`` and ``reqs`` hashes and the ``fifo`` members): every
    node's count is the number of recorded requests whose order passes through it, every field belongs to a
    node some request holds, and the fifo names exactly the recorded requests. Raises IndexIntegrityError. Pure;
    O(state); for tests and tools."""
    from collections import Counter

    from cpmemory.errors import IndexIntegrityError

    children: dict[bytes, dict[bytes, bytes]] = {b"": {}}  # parent id -> block -> ENTRY
    for field_name, value in trie.items():
        if len(field_name) == 8:
            children[b""][field_name] = value
        elif len(field_name) == 14:
            children.setdefault(field_name[:6], {})[field_name[6:]] = value
        elif len(field_name) == 6 and value:
            records = children.setdefault(field_name, {})
            if len(value) % _RECORD_BYTES:
                raise IndexIntegrityError(f"trie node {field_name.hex()}: children of {len(value)} bytes")
            for at in range(0, len(value), _RECORD_BYTES):
                records[value[at : at + 8]] = value[at + 8 : at + _RECORD_BYTES]
        elif len(field_name) != 6:
            raise IndexIntegrityError(f"trie field of {len(field_name)} bytes")
    expected: Counter[tuple[bytes, bytes]] = Counter()
    for request, path in paths.items():
        parent = b""
        for at in range(0, len(path), 8):
            block = path[at : at + 8]
            entry = children.get(parent, {}).get(block)
            if entry is None:
                raise IndexIntegrityError(f"request {request!r}: no trie node for block {at // 8} of its order")
            expected[(parent, block)] += 1
            parent = _entry(entry)[0]
    for parent, blocks in children.items():
        for block, entry in blocks.items():
            if _entry(entry)[1] != expected.get((parent, block), 0):
                raise IndexIntegrityError(f"trie node under {parent.hex() or 'the root'}: count {_entry(entry)[1]}, "
                                          f"{expected.get((parent, block), 0)} recorded requests through it")
    ids = {_entry(entry)[0] for blocks in children.values() for entry in blocks.values()}
    marks = {name for name, value in trie.items() if len(name) == 6 and not value}
    orphans = (set(children) - {b""} | marks) - ids
    if orphans:
        raise IndexIntegrityError(f"{len(orphans)} trie fields hold children of no node")
    if sorted(fifo) != sorted(paths):
        raise IndexIntegrityError(f"fifo holds {len(fifo)} ids, {len(paths)} requests are recorded")


def distinct_sizes(pairs: Sequence[tuple[str, str]], sizes: Sequence[float]) -> tuple[list[str], list[float]]:
    """The distinct content hashes of a reserve request's (id, hash) pairs, first occurrence, with their sizes."""
    seen: dict[str, float] = {}
    for (_, digest), size in zip(pairs, sizes):
        seen.setdefault(digest, size)
    return list(seen), list(seen.values())
