"""A tenant's shared decision state in Redis: the online orderer (``cpmemory.core.online``) run by ``decide.lua``.

When the facade's store is Redis, what decides block orders lives there, under the store's prefix and one hash tag
per tenant (``P:{T}:ord:*``, see :meth:`cpmemory.stores.keys.KeyScheme.decision_keys`): K facades on one Redis and
prefix decide as one, and a restarted process resumes. The calls ride in the same round trip as the session state:
``reserve`` pipelines the ``order`` call (observe + order), ``commit`` pipelines the ``record`` call (the order
sent and its request id), so a request costs 2 round trips in all. Bounded per tenant: ``max_requests`` recorded
orders (the oldest forgotten first; about 15 trie nodes and one path string each), ``max_blocks`` counted blocks
(beyond, the counts and postings restart; a posting keeps the last ``posting_length`` requests of a block), and the
conversation TTL on every key. Sans-IO: this module builds calls and decodes
replies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpmemory.stores.keys import KeyScheme, decode_text

DECISION_SCRIPT = "decide"


@dataclass(frozen=True, slots=True)
class DecisionLimits:
    """Bounds of one tenant's shared decision state."""

    max_requests: int = 100_000
    max_blocks: int = 200_000
    ttl_ms: int = 0
    match_budget: int = 64  # = cpmemory.core.online.MATCH_BUDGET (a test keeps them equal)
    recency_scale: float = 50.0  # = cpmemory.core.online.RECENCY_SCALE
    posting_length: int = 16  # = cpmemory.core.online.POSTING_LENGTH


class DecisionCodec:
    """Builds ``decide.lua`` calls (script name, KEYS, ARGV) and decodes their replies. Pure."""

    __slots__ = ("keys", "limits")

    def __init__(self, keys: KeyScheme, limits: DecisionLimits) -> None:
        self.keys = keys
        self.limits = limits

    def _head(self, mode: str, request_id: str) -> tuple[object, ...]:
        limits = self.limits
        return (mode, limits.ttl_ms, limits.max_requests, limits.max_blocks, request_id, limits.match_budget,
                repr(limits.recency_scale), limits.posting_length)

    def order_call(self, tenant: str, hashes: Sequence[str], sizes: Sequence[float], request_id: str = "",
                   record: bool = False) -> tuple[str, tuple[str, ...], tuple[object, ...]]:
        """Observe and order a request's distinct ``hashes`` (recorded at once as ``request_id`` when ``record``)."""
        pairs: list[object] = []
        for digest, size in zip(hashes, sizes):
            pairs.extend((digest, repr(float(size))))
        mode = "both" if record else "order"
        return DECISION_SCRIPT, self.keys.decision_keys(tenant), (*self._head(mode, request_id), *pairs)

    def record_call(self, tenant: str, order: Sequence[str], request_id: str
                    ) -> tuple[str, tuple[str, ...], tuple[object, ...]]:
        """Record that ``order`` was sent as ``request_id``."""
        return DECISION_SCRIPT, self.keys.decision_keys(tenant), (*self._head("record", request_id), *order)

    def evict_call(self, tenant: str, request_ids: Sequence[str]) -> tuple[str, tuple[str, ...], tuple[object, ...]]:
        """Take evicted requests' weight off their paths."""
        return DECISION_SCRIPT, self.keys.decision_keys(tenant), (*self._head("evict", ""), *request_ids)

    @staticmethod
    def parse_order(reply: Sequence[bytes | str]) -> tuple[str, ...]:
        """The order returned by an ``order`` / ``both`` call."""
        return tuple(decode_text(value) for value in reply)


def distinct_sizes(pairs: Sequence[tuple[str, str]], sizes: Sequence[float]) -> tuple[list[str], list[float]]:
    """The distinct content hashes of a reserve request's (id, hash) pairs, first occurrence, with their sizes."""
    seen: dict[str, float] = {}
    for (_, digest), size in zip(pairs, sizes):
        seen.setdefault(digest, size)
    return list(seen), list(seen.values())
