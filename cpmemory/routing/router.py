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

Session routing (``policy="session"``, what vllm-router's session affinity and most gateways do): a key's first call
goes to the least loaded replica (fewest in flight, then fewest sent), its sticky calls back to that replica (unless
it is down or overloaded). Unlike the hash, the placement follows the load, so a few long conversations cannot all
land on one replica by the luck of their ids.

Prefix-aware routing (``policy="prefix"``, the default, when the caller passes the prompt's blocks and the router has
a :class:`~cpmemory.routing.prefix.PrefixView`): a request that carries no conversation history goes to the replica
with the best score (cached share of the prompt, in-flight requests, KV utilisation; see ``routing.prefix``) among
those within a bounded load (at most ``load_factor`` times the mean in flight plus ``load_slack``), ties broken by rendezvous
rank. A *sticky* request (a conversation's later turn, a Chain-of-Agents job) goes back to the replica its key went
to last (a bounded LRU map), unless that replica is down or overloaded, with or without the prompt's blocks (a
prompt that could not be tokenized does not move a conversation); a key the map does not know (another worker's, or
after a restart) is routed by prefix, which finds where its history is cached.

A replica is marked down on a connection error or timeout (``mark_down``) and brought back by ``probe``, which calls
a health check on every down replica. Every method is O(R log R) for R replicas (plus O(blocks) for the prefix
match); nothing here does IO itself.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cpmemory.errors import InvalidInputError, NoHealthyReplicaError
from cpmemory.routing.fleet import FleetView, ReplicaRecord
from cpmemory.routing.prefix import PrefixView, PromptBlocks, Weights, replica_score

RouteReason = Literal["affinity", "prefix", "cold", "load", "failover", "fit", "lane"]
ROUTE_REASONS: tuple[RouteReason, ...] = ("affinity", "prefix", "cold", "load", "failover", "fit", "lane")


class RouterConfig(BaseModel):
    """Tunables of the router (all optional)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    balance_abs_threshold: int = Field(default=32, ge=0, description="in-flight gap that allows a load fallback")
    balance_rel_threshold: float = Field(default=1.5, ge=1.0, description="load ratio that allows a load fallback")
    probe_interval_s: float = Field(default=2.0, gt=0, description="how often down replicas are probed")
    policy: Literal["prefix", "affinity", "session"] = Field(
        default="prefix", description="prefix: score by cached prefix and load; affinity: rendezvous of the key "
                                      "only; session: least loaded first, then sticky")
    prefix_weight: float = Field(default=2.0, ge=0, description="weight of the cached share of the prompt")
    queue_weight: float = Field(default=0.25, ge=0, description="weight of in-flight requests (over the busiest)")
    kv_weight: float = Field(default=1.0, ge=0, description="weight of the replica's KV-cache utilisation")
    load_factor: float = Field(default=1.25, ge=1.0, description="bounded load: in flight <= factor * mean + slack")
    load_slack: float = Field(default=2.0, ge=0, description="requests a replica may run above the bounded load")
    sticky_keys: int = Field(default=100_000, ge=1, description="conversations / jobs remembered for affinity")


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
    record: ReplicaRecord  # its load, in the fleet's record (cpmemory.routing.fleet)
    healthy: bool = True
    failures: int = 0
    down_since: float | None = None

    @property
    def in_flight(self) -> int:
        return self.record.in_flight

    @property
    def requests(self) -> int:
        return self.record.requests


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
        reason: ``affinity`` (the key's replica), ``prefix`` (the longest cached prefix, within the load bound),
            ``cold`` (no replica holds any of the prompt: load and rendezvous rank decided), ``load`` (the
            affinity or longest-prefix replica was overloaded: a less loaded one was taken), ``failover`` (the
            first choice is down or was excluded), ``fit`` (the proxy's cache-fit admission placed a new
            conversation where its history fits, cpmemory.server.fit), ``lane`` (the proxy's hold split a window over
            the replicas and this call's lane runs there, cpmemory.server.hold).
        cached_blocks: leading prompt blocks the view says the chosen replica holds (0 without a prompt).
    """

    url: str
    index: int
    reason: RouteReason
    cached_blocks: int = 0


class Router:
    """Chooses an engine replica per affinity key. Not thread-safe; use it from one event loop."""

    def __init__(
        self,
        urls: Iterable[str],
        config: RouterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        view: PrefixView | None = None,
        fleet: FleetView | None = None,
    ) -> None:
        """Create a router over ``urls`` (base URLs, e.g. ``http://127.0.0.1:8000``); no IO.

        ``view`` is what the router knows of the replicas' caches (None: prefix routing is off; keys decide).
        ``fleet`` holds the replicas' records the router counts their load in and reads their caches from (its
        ``blocks`` is ``view`` when ``view`` is given; None: a fleet of its own).

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
        self.fleet = fleet if fleet is not None else FleetView(len(cleaned))
        if view is not None:
            self.fleet.blocks = view
        self._replicas = [_ReplicaState(url, self.fleet.record(position)) for position, url in enumerate(cleaned)]
        self._by_url = {state.url: position for position, state in enumerate(self._replicas)}
        self._sticky: OrderedDict[str, int] = OrderedDict()
        cfg = self.config
        self._weights = Weights(cfg.prefix_weight, cfg.queue_weight, cfg.kv_weight)

    @property
    def view(self) -> PrefixView | None:
        """What the router knows of the replicas' caches: the fleet's block view."""
        return self.fleet.blocks

    @view.setter
    def view(self, view: PrefixView | None) -> None:
        self.fleet.blocks = view

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

    def choose(self, key: str, exclude: Iterable[str] = (), *, prompt: PromptBlocks | None = None,
               sticky: bool = False) -> RouteDecision:
        """Pick the replica for ``key``, skipping down replicas and ``exclude``. Does not change state.

        Args:
            key: the affinity key (conversation, job, prefix); ranks replicas by rendezvous weight.
            exclude: replicas already tried for this call.
            prompt: the prompt's blocks; with a view and ``policy="prefix"`` the cached prefix is scored.
            sticky: the key's earlier calls carry context (a conversation's later turn, a job): keep its replica.

        Raises:
            NoHealthyReplicaError: every replica is down or excluded.
        """
        excluded = set(exclude)
        ranked = self.ranking(key)
        usable = [self._replicas[self._by_url[url]] for url in ranked if url not in excluded]
        usable = [state for state in usable if state.healthy]
        if not usable:
            raise NoHealthyReplicaError(f"no healthy engine replica among {len(ranked)} (excluded {len(excluded)})")
        least = min(usable, key=lambda state: state.in_flight)  # min keeps the first (best ranked) on ties
        if self.config.policy == "session":
            return self._choose_by_session(key, usable, sticky)
        if self.view is None or self.config.policy == "affinity":
            return self._choose_by_key(usable, least, ranked[0])
        remembered = self._sticky.get(key) if sticky else None
        lost = False  # the key's replica is down or excluded: whatever is chosen is a failover
        if remembered is not None:
            state = self._replicas[remembered]
            lost = state not in usable
            if not lost and not self._overloaded(state.in_flight, least.in_flight):
                matched = self.view.matched_blocks(remembered, prompt) if prompt is not None else 0
                return RouteDecision(state.url, remembered, "affinity", matched)
        if prompt is None:  # nothing to score (e.g. the prompt could not be tokenized): the key decides
            decision = self._choose_by_key(usable, least, ranked[0])
            return replace(decision, reason="failover") if lost and decision.reason == "affinity" else decision
        decision = self._choose_by_prefix(usable, prompt, failover=bool(excluded) or lost)
        if self._overloaded(self._replicas[decision.index].in_flight, least.in_flight):  # SGLang's imbalance rule
            position = self._by_url[least.url]
            return RouteDecision(least.url, position, "load", self.view.matched_blocks(position, prompt))
        return decision

    def placed(self, index: int, prompt: PromptBlocks | None = None, reason: RouteReason = "fit"
               ) -> RouteDecision | None:
        """The decision for a call placed on replica ``index`` by the proxy (``fit``: cache-fit admission; ``lane``:
        a held window's split); None when that replica is down (the call is then routed as usual). Pure."""
        if not 0 <= index < len(self._replicas) or not self._replicas[index].healthy:
            return None
        state = self._replicas[index]
        matched = self.view.matched_blocks(index, prompt) if self.view is not None and prompt is not None else 0
        return RouteDecision(state.url, index, reason, matched)

    def sticky_replica(self, key: str) -> int | None:
        """The replica a sticky call for ``key`` goes back to now (prefix policy: remembered, healthy, not
        overloaded), else None; then ``choose`` needs no prompt to route it. Pure, O(R)."""
        if self.view is None or self.config.policy == "affinity":
            return None
        remembered = self._sticky.get(key)
        if remembered is None or not self._replicas[remembered].healthy:
            return None
        least = min((state.in_flight for state in self._replicas if state.healthy), default=0)
        return None if self._overloaded(self._replicas[remembered].in_flight, least) else remembered

    def _choose_by_session(self, key: str, usable: list[_ReplicaState], sticky: bool) -> RouteDecision:
        """The key's remembered replica for a sticky call (while usable and not overloaded), else the least loaded
        (fewest in flight, then fewest requests so far, then rendezvous rank)."""
        least = min(usable, key=lambda state: (state.in_flight, state.requests))
        remembered = self._sticky.get(key) if sticky else None
        reason: RouteReason = "cold"
        if remembered is not None:
            state = self._replicas[remembered]
            if state not in usable:
                reason = "failover"
            elif not self._overloaded(state.in_flight, least.in_flight):
                return RouteDecision(state.url, remembered, "affinity")
            else:
                reason = "load"
        return RouteDecision(least.url, self._by_url[least.url], reason)

    def _choose_by_key(self, usable: list[_ReplicaState], least: _ReplicaState, first: str) -> RouteDecision:
        preferred = usable[0]
        if self._overloaded(preferred.in_flight, least.in_flight):
            return RouteDecision(least.url, self._by_url[least.url], "load")
        reason: RouteReason = "affinity" if preferred.url == first else "failover"
        return RouteDecision(preferred.url, self._by_url[preferred.url], reason)

    def _choose_by_prefix(self, usable: list[_ReplicaState], prompt: PromptBlocks, *, failover: bool
                          ) -> RouteDecision:
        """Best score among the replicas within the bounded load (usable is in rendezvous order: ties keep it)."""
        view = self.view
        assert view is not None
        matched = {}
        for state in usable:
            position = self._by_url[state.url]
            matched[position] = view.matched_blocks(position, prompt) if view.synced(position) else 0
        total = sum(state.in_flight for state in usable)
        cap = self.config.load_factor * (total + 1) / len(usable) + self.config.load_slack
        eligible = [state for state in usable if state.in_flight + 1 <= cap] or usable
        busiest = max(state.in_flight for state in eligible)
        best: tuple[float, int] | None = None
        for state in eligible:
            position = self._by_url[state.url]
            score = replica_score(self._weights, prompt.fraction(matched[position]), state.in_flight, busiest,
                                  view.utilisation(position))
            if best is None or score > best[0]:
                best = (score, position)
        assert best is not None
        position = best[1]
        longest = max(matched.values())
        reason: RouteReason = "cold" if not longest else "prefix" if matched[position] >= longest else "load"
        if failover and reason != "prefix":
            reason = "failover"
        return RouteDecision(self._replicas[position].url, position, reason, matched[position])

    def record(self, key: str, decision: RouteDecision, prompt: PromptBlocks | None = None,
               *, sticky: bool = False) -> None:
        """A call for ``key`` was sent to ``decision``: remember it for affinity and in the view. O(blocks)."""
        if sticky:
            self._sticky[key] = decision.index
            self._sticky.move_to_end(key)
            while len(self._sticky) > self.config.sticky_keys:
                self._sticky.popitem(last=False)
        if prompt is not None:
            self.fleet.send(decision.index, prompt)

    def _overloaded(self, preferred_load: int, least_load: int) -> bool:
        gap_exceeded = preferred_load - least_load > self.config.balance_abs_threshold
        return gap_exceeded and preferred_load > self.config.balance_rel_threshold * least_load

    def begin(self, url: str) -> None:
        """Count one request in flight on ``url`` (call ``end`` when it finishes, success or not)."""
        self.fleet.begin(self._position(url))

    def end(self, url: str) -> None:
        """Count one request on ``url`` as finished."""
        self.fleet.end(self._position(url))

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

    def is_healthy(self, url: str) -> bool:
        """Whether ``url`` is in rotation."""
        return self._state(url).healthy

    def healthy_count(self) -> int:
        """Number of replicas in rotation."""
        return sum(1 for state in self._replicas if state.healthy)

    def healthy_indices(self) -> list[int]:
        """The indices (configuration order) of the replicas in rotation."""
        return [index for index, state in enumerate(self._replicas) if state.healthy]

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

    def _position(self, url: str) -> int:
        position = self._by_url.get(url.rstrip("/"))
        if position is None:
            raise InvalidInputError(f"unknown replica {url!r}")
        return position

    def _state(self, url: str) -> _ReplicaState:
        return self._replicas[self._position(url)]
