"""Replica selection: cache affinity by rendezvous hashing, a load-aware fallback, failover and health probes.

Calls that share context (one conversation's turns, the agents of one Chain-of-Agents job, requests on one index
branch) carry the same *affinity key*. The key picks a replica by rendezvous (highest-random-weight) hashing over the
healthy replicas, so:

* the mapping is stateless: no per-conversation table grows with traffic (memory stays bounded);
* when a replica goes down only the keys it owned move (to their second choice), and they come back when it
  recovers;
* the ranking of all replicas for a key is also the failover order.

Load-aware fallback, in the spirit of SGLang's cache-aware router: the router counts in-flight requests per replica;
when the preferred replica has more than ``balance_abs_threshold`` requests above the least loaded one *and* more than
``balance_rel_threshold`` times its load, the call goes to the least loaded replica instead (cache affinity is given up
only when the imbalance would cost more than the cache saves).

A replica is marked down on a connection error or timeout (``mark_down``) and brought back by ``probe``, which calls
a health check on every down replica. Every method is O(R log R) for R replicas; nothing here does IO itself.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cpmemory.errors import InvalidInputError, NoHealthyReplicaError

RouteReason = Literal["affinity", "load", "failover"]


class RouterConfig(BaseModel):
    """Tunables of the router (all optional)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    balance_abs_threshold: int = Field(default=32, ge=0, description="in-flight gap that allows a load fallback")
    balance_rel_threshold: float = Field(default=1.5, ge=1.0, description="load ratio that allows a load fallback")
    probe_interval_s: float = Field(default=2.0, gt=0, description="how often down replicas are probed")


def _length_prefixed(*parts: str) -> str:
    # Length prefixes make the key injective: ("a:b", "c") and ("a", "b:c") never collide.
    return "|".join(f"{len(part)}:{part}" for part in parts)


def conversation_affinity_key(tenant: str, conversation_id: str) -> str:
    """Affinity key of one conversation of one tenant (all its turns go to one replica)."""
    return "conversation|" + _length_prefixed(tenant, conversation_id)


def job_affinity_key(tenant: str, job_id: str) -> str:
    """Affinity key of one Chain-of-Agents job (workers and manager share its context)."""
    return "job|" + _length_prefixed(tenant, job_id)


def branch_affinity_key(tenant: str, search_path: Sequence[int]) -> str:
    """Affinity key of an index branch: the tenant and the first element of the search path.

    Requests whose contexts sit under one top-level branch of the index share a prefix, so they are sent to one
    replica. An empty path (a context that shares nothing) falls back to the tenant's own key.
    """
    head = str(search_path[0]) if search_path else "-"
    return "branch|" + _length_prefixed(tenant, head)


def _weight(key: str, url: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{url}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(slots=True)
class _ReplicaState:
    url: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    down_since: float | None = None


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """A snapshot of one replica (for /healthz, metrics and tests)."""

    index: int
    url: str
    healthy: bool
    in_flight: int
    requests: int
    failures: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one call goes, and why.

    Attributes:
        url: the chosen replica's base URL.
        index: its position in the router's replica list.
        reason: ``affinity`` (the key's first choice), ``failover`` (the first choice is down or was excluded),
            ``load`` (the affinity choice was overloaded; the least loaded replica was taken).
    """

    url: str
    index: int
    reason: RouteReason


class Router:
    """Chooses an engine replica per affinity key. Not thread-safe; use it from one event loop."""

    def __init__(
        self,
        urls: Iterable[str],
        config: RouterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create a router over ``urls`` (base URLs, e.g. ``http://127.0.0.1:8000``); no IO.

        Raises:
            InvalidInputError: no URL, or a repeated URL.
        """
        cleaned = [url.rstrip("/") for url in urls]
        if not cleaned:
            raise InvalidInputError("the router needs at least one engine URL")
        if len(set(cleaned)) != len(cleaned):
            raise InvalidInputError("engine URLs must be distinct")
        self.config = config or RouterConfig()
        self._clock = clock
        self._replicas = [_ReplicaState(url) for url in cleaned]
        self._by_url = {state.url: position for position, state in enumerate(self._replicas)}

    @property
    def urls(self) -> tuple[str, ...]:
        """Base URLs of every replica, in configuration order."""
        return tuple(state.url for state in self._replicas)

    def status(self) -> tuple[ReplicaStatus, ...]:
        """Snapshot of every replica."""
        return tuple(
            ReplicaStatus(i, s.url, s.healthy, s.in_flight, s.requests, s.failures)
            for i, s in enumerate(self._replicas)
        )

    def ranking(self, key: str) -> list[str]:
        """All replica URLs ordered by rendezvous weight for ``key`` (healthy or not). Pure, O(R log R)."""
        return sorted(self.urls, key=lambda url: _weight(key, url), reverse=True)

    def choose(self, key: str, exclude: Iterable[str] = ()) -> RouteDecision:
        """Pick the replica for ``key``, skipping down replicas and ``exclude``. Does not change state.

        Raises:
            NoHealthyReplicaError: every replica is down or excluded.
        """
        excluded = set(exclude)
        ranked = self.ranking(key)
        usable = [self._replicas[self._by_url[url]] for url in ranked if url not in excluded]
        usable = [state for state in usable if state.healthy]
        if not usable:
            raise NoHealthyReplicaError(f"no healthy engine replica among {len(ranked)} (excluded {len(excluded)})")
        preferred = usable[0]
        least = min(usable, key=lambda state: state.in_flight)  # min keeps the first (best ranked) on ties
        if self._overloaded(preferred.in_flight, least.in_flight):
            return RouteDecision(least.url, self._by_url[least.url], "load")
        reason: RouteReason = "affinity" if preferred.url == ranked[0] else "failover"
        return RouteDecision(preferred.url, self._by_url[preferred.url], reason)

    def _overloaded(self, preferred_load: int, least_load: int) -> bool:
        gap_exceeded = preferred_load - least_load > self.config.balance_abs_threshold
        return gap_exceeded and preferred_load > self.config.balance_rel_threshold * least_load

    def begin(self, url: str) -> None:
        """Count one request in flight on ``url`` (call ``end`` when it finishes, success or not)."""
        state = self._state(url)
        state.in_flight += 1
        state.requests += 1

    def end(self, url: str) -> None:
        """Count one request on ``url`` as finished."""
        state = self._state(url)
        state.in_flight = max(0, state.in_flight - 1)

    def mark_down(self, url: str) -> None:
        """Take ``url`` out of rotation (connection error, timeout) until ``mark_up`` or a successful probe."""
        state = self._state(url)
        state.failures += 1
        if state.healthy:
            state.healthy = False
            state.down_since = self._clock()

    def mark_up(self, url: str) -> None:
        """Put ``url`` back into rotation."""
        state = self._state(url)
        state.healthy = True
        state.down_since = None

    def healthy_count(self) -> int:
        """Number of replicas in rotation."""
        return sum(1 for state in self._replicas if state.healthy)

    async def probe(self, is_healthy: Callable[[str], Awaitable[bool]]) -> list[str]:
        """Run ``is_healthy`` on every down replica; bring back those that answer True. Returns their URLs.

        A health check that raises counts as "still down" (the exception is not propagated).
        """
        recovered: list[str] = []
        for state in self._replicas:
            if state.healthy:
                continue
            try:
                ok = await is_healthy(state.url)
            except Exception:  # noqa: BLE001 - any failure of a probe means "still down"
                ok = False
            if ok:
                self.mark_up(state.url)
                recovered.append(state.url)
        return recovered

    def _state(self, url: str) -> _ReplicaState:
        position = self._by_url.get(url.rstrip("/"))
        if position is None:
            raise InvalidInputError(f"unknown replica {url!r}")
        return self._replicas[position]
