"""One view of the fleet: per replica, one record of what it holds and what it runs, in tokens.

:class:`FleetView` keeps a :class:`ReplicaRecord` per replica and is the one place the proxy's components read
about a replica:

* **what it holds**, in two indexes of the same cache: by the prompt's blocks (``blocks``: a
  :class:`~cpmemory.routing.prefix.PrefixView`, fed by the replica's KV events where given, by what was sent
  otherwise), which the router scores; and by planned block order (:class:`SentOrders`), which the hold's ``pick``
  scores held requests with (a held request is not prepared yet, so it has no prompt to hash, only a planned order);
* **what it runs**: the requests in flight there and the requests sent so far (the router counts them), and the
  requests and tokens the hold's ``pick`` released there and that have not ended;
* **its KV capacity in tokens** (read from the engine by cache-fit admission, else configured), which bounds the
  order index; sizes given in characters are converted with the proxy's tokens-per-character calibration.

Use it from one event loop (the block index of an event-fed view is thread-safe on its own).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from cpmemory.routing.prefix import PrefixView, PromptBlocks, SentPrefixView

DEFAULT_TOKENS_PER_CHAR = 0.25
"""Tokens per character until a calibration is given (the router's ``CHARS_PER_TOKEN``)."""


@dataclass(slots=True)
class ReplicaRecord:
    """What one replica runs (plain counters, written by the router and the hold's pick).

    Attributes:
        index: the replica's position in the fleet.
        in_flight: requests sent there that have not finished (the router's count, every request).
        requests: requests sent there so far.
        picked: requests the hold's ``pick`` released there that have not ended.
        picked_tokens: their estimated tokens.
    """

    index: int
    in_flight: int = 0
    requests: int = 0
    picked: int = 0
    picked_tokens: int = 0


class SentOrders:
    """Per replica, the block orders sent there, bounded by its cache, least recently used dropped first.

    Prefix *i* of an order names its first *i + 1* blocks; a request's cached share on a replica is the size of
    the longest run of its order's prefixes that replica holds. An order's deepest blocks are dropped before its
    first ones (an engine frees a request's blocks tail first).

    Args:
        capacity: the size a replica's cache holds, in the unit of the block sizes (None: unbounded, e.g. while
            the engine's cache size is unknown).
    """

    def __init__(self, capacity: Callable[[int], float | None]) -> None:
        self._capacity = capacity
        self._replicas: dict[int, OrderedDict[int, float]] = {}
        self._totals: dict[int, float] = {}

    @staticmethod
    def _chain(keys: Sequence[Hashable]) -> list[int]:
        chained, parent = [], 0
        for key in keys:
            parent = hash((parent, key))
            chained.append(parent)
        return chained

    def record(self, replica: int, keys: Sequence[Hashable], sizes: Sequence[float]) -> None:
        """A prompt whose blocks ``keys`` (of ``sizes``), in this order, follow the system prompt was sent to
        ``replica``. O(len(keys)) plus what is dropped."""
        if len(keys) != len(sizes):
            raise ValueError("record needs one size per key")
        prefixes = self._replicas.setdefault(replica, OrderedDict())
        total = self._totals.get(replica, 0.0)
        chained = self._chain(keys)
        for prefix, size in zip(reversed(chained), reversed(sizes)):  # the first block ends most recent
            if prefix in prefixes:
                prefixes.move_to_end(prefix)
            else:
                prefixes[prefix] = float(size)
                total += float(size)
        capacity = self._capacity(replica)
        while capacity is not None and total > capacity and prefixes:
            total -= prefixes.popitem(last=False)[1]
        self._totals[replica] = total

    def cached(self, replica: int, keys: Sequence[Hashable]) -> float:
        """The size of the longest prefix of the order ``keys`` that ``replica`` holds. Pure; O(its length)."""
        prefixes = self._replicas.get(replica)
        if not prefixes:
            return 0.0
        found = 0.0
        for prefix in self._chain(keys):
            size = prefixes.get(prefix)
            if size is None:
                break
            found += size
        return found

    def held(self, replica: int) -> float:
        """The size of what ``replica`` holds in this view."""
        return self._totals.get(replica, 0.0)

    def clear(self, replica: int) -> None:
        """Forget what ``replica`` holds (its engine restarted or cleared its cache)."""
        self._replicas.pop(replica, None)
        self._totals.pop(replica, None)


class FleetView:
    """One :class:`ReplicaRecord` per replica, the replicas' cached blocks and block orders, their capacities.

    Args:
        replicas: how many replicas (index = position in the router).
        blocks: what each replica caches by prompt blocks (the router's view; None: prefix routing is off).
        capacity_tokens: ``capacity_tokens(replica)``: its KV cache in tokens, None while unknown.
        tokens_per_char: the current tokens-per-character calibration (sizes given in characters are converted
            with it when they are recorded).
        follow_orders: keep the block orders sent to each replica (the hold's ``pick`` reads them; off otherwise,
            so nothing grows that nothing reads).
    """

    def __init__(self, replicas: int, blocks: PrefixView | None = None, *,
                 capacity_tokens: Callable[[int], int | None] = lambda replica: None,
                 tokens_per_char: Callable[[], float] = lambda: DEFAULT_TOKENS_PER_CHAR,
                 follow_orders: bool = False) -> None:
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        self._records = [ReplicaRecord(index) for index in range(replicas)]
        self.blocks = blocks
        self.capacity_tokens = capacity_tokens
        self.tokens_per_char = tokens_per_char
        self.follow_orders = follow_orders
        self.orders = SentOrders(lambda replica: self._order_capacity(replica))

    def _order_capacity(self, replica: int) -> float | None:
        size = self.capacity_tokens(replica)
        return None if size is None else float(size)

    # -- records -------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._records)

    def record(self, replica: int) -> ReplicaRecord:
        """The replica's record (created on first use for an index past the configured replicas)."""
        while replica >= len(self._records):
            self._records.append(ReplicaRecord(len(self._records)))
        return self._records[replica]

    @property
    def records(self) -> tuple[ReplicaRecord, ...]:
        """Every replica's record (live objects), in index order."""
        return tuple(self._records)

    def begin(self, replica: int) -> None:
        """A request was sent to ``replica``."""
        record = self.record(replica)
        record.in_flight += 1
        record.requests += 1

    def end(self, replica: int) -> None:
        """A request on ``replica`` finished (success or not)."""
        record = self.record(replica)
        record.in_flight = max(0, record.in_flight - 1)

    def picked(self, replica: int, tokens: int) -> None:
        """The hold's pick released a request of ``tokens`` to ``replica``."""
        record = self.record(replica)
        record.picked += 1
        record.picked_tokens += tokens

    def unpicked(self, replica: int, tokens: int) -> None:
        """A request the pick counted on ``replica`` ended there or moved elsewhere."""
        record = self.record(replica)
        record.picked = max(0, record.picked - 1)
        record.picked_tokens = max(0, record.picked_tokens - tokens)

    # -- what a replica holds ------------------------------------------------------------------------------------
    def send(self, replica: int, prompt: PromptBlocks) -> None:
        """``prompt`` was routed to ``replica``: its blocks count there (pending until the events report them,
        with an event-fed view)."""
        if self.blocks is not None:
            self.blocks.record(replica, prompt)

    def cached_tokens(self, replica: int, prompt: PromptBlocks) -> int:
        """Tokens of ``prompt``'s leading blocks the replica holds (0 without a block view or while unsynced)."""
        if self.blocks is None or not self.blocks.synced(replica):
            return 0
        matched = self.blocks.matched_blocks(replica, prompt)
        return min(prompt.total_tokens, matched * prompt.block_tokens)

    def utilisation(self, replica: int) -> float:
        """Share of the replica's KV cache the block view counts in use (0..1; 0 without a block view)."""
        return 0.0 if self.blocks is None else self.blocks.utilisation(replica)

    def send_order(self, replica: int, keys: Sequence[Hashable], chars: Sequence[int]) -> None:
        """A prompt whose blocks ``keys`` (of ``chars`` characters each) open a conversation was sent to
        ``replica``: record the order in tokens (nothing unless ``follow_orders``)."""
        if not self.follow_orders:
            return
        ratio = self.tokens_per_char()
        self.orders.record(replica, keys, [size * ratio for size in chars])

    def cached_order(self, replica: int, keys: Sequence[Hashable]) -> float:
        """Tokens of the longest prefix of the planned block order ``keys`` that ``replica`` holds."""
        return self.orders.cached(replica, keys)

    def order_tokens(self, replica: int) -> float:
        """Tokens the order index counts on ``replica``."""
        return self.orders.held(replica)

    def clear(self, replica: int) -> None:
        """The replica's cache was emptied (its engine restarted): forget its block orders. An event-fed block
        view learns it from the engine's ``AllBlocksCleared``."""
        self.orders.clear(replica)
        if isinstance(self.blocks, SentPrefixView):
            self.blocks.clear(replica)
