"""Several simulated engine replicas behind the product's router (``bench replay --online --replicas N``).

A :class:`ReplicaFleet` holds N ``PrefixCacheSimulator`` caches of ``capacity / N`` tokens each and routes every
prompt with :class:`cpmemory.routing.router.Router`, the proxy's own router:

* ``router="prefix"``: the router scores replicas by the cached prefix of the prompt (its
  :class:`~cpmemory.routing.prefix.SentPrefixView` of what was sent where, in blocks of ``block_size`` tokens, each
  replica's view bounded by its capacity: what the proxy knows without KV events) and by load;
* ``router="affinity"``: rendezvous hashing of the request's key (its conversation), the pre-prefix behaviour.

Load: time is a request counter, so "in flight" is simulated as the last ``concurrency`` requests (each request
runs while the next ``concurrency - 1`` arrive). The fleet reports requests, prompt and cached tokens per replica,
and ``load_max_over_mean``: the busiest replica's request count over the mean.

A fleet has the one-cache interface the replays use (``run(tokens) -> cached tokens``, ``peek``), plus the key of
the request's conversation and whether it carries history (a later turn keeps its replica).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from cpmemory.bench.simulator import SimulatorMode
from cpmemory.errors import InvalidInputError

RouterName = Literal["prefix", "affinity"]
ROUTERS: tuple[RouterName, ...] = ("prefix", "affinity")


def router_name(text: str) -> RouterName:
    """``text`` as a router name (a command-line value).

    Raises:
        InvalidInputError: not one of :data:`ROUTERS`.
    """
    for name in ROUTERS:
        if text == name:
            return name
    raise InvalidInputError(f"--router must be one of {', '.join(ROUTERS)}, got {text!r}")


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """How the replicas are simulated.

    Attributes:
        replicas: number of replicas N (each gets ``capacity // N`` tokens).
        router: ``prefix`` (the product's default) or ``affinity`` (rendezvous of the conversation key).
        concurrency: requests simulated in flight at once (the router's load signal).
        block_size: tokens per block of the router's prefix view.
    """

    replicas: int = 4
    router: RouterName = "prefix"
    concurrency: int = 32
    block_size: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise InvalidInputError(f"--replicas must be an integer >= 1, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise InvalidInputError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.concurrency < 1 or self.block_size < 1:
            raise InvalidInputError("concurrency and block_size must be >= 1")


@dataclass(frozen=True, slots=True)
class ReplicaFigures:
    """What one replica served."""

    requests: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens (0 when it served nothing)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class FleetReport:
    """Per-replica figures of a fleet run, and the route decisions by reason."""

    replicas: tuple[ReplicaFigures, ...]
    reasons: dict[str, int]

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens over every replica."""
        prompt = sum(r.prompt_tokens for r in self.replicas)
        return sum(r.cached_tokens for r in self.replicas) / prompt if prompt else 0.0

    @property
    def load_max_over_mean(self) -> float:
        """The busiest replica's requests over the mean (1.0 is perfectly even)."""
        loads = [r.requests for r in self.replicas]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0

    def to_json(self) -> dict[str, Any]:
        """The ``replicas`` object of a strategy's JSON."""
        return {
            "hit_rate": round(self.hit_rate, 6),
            "load_max_over_mean": round(self.load_max_over_mean, 4),
            "requests": [r.requests for r in self.replicas],
            "hit_rates": [round(r.hit_rate, 6) for r in self.replicas],
            "route_reasons": dict(sorted(self.reasons.items())),
        }


class ReplicaFleet:
    """N simulated caches behind the product's router; deterministic for a given prompt stream. Not thread-safe."""

    def __init__(self, capacity_tokens: int, settings: FleetSettings = FleetSettings(), *, mode: SimulatorMode = "radix",
                 page_size: int | None = None) -> None:
        """Create N empty caches of ``capacity_tokens // N`` tokens and a router over them.

        Raises:
            InvalidInputError: bad settings or simulator arguments.
        """
        from cpmemory.bench.simulator import PrefixCacheSimulator
        from cpmemory.routing.prefix import SentPrefixView
        from cpmemory.routing.router import Router, RouterConfig

        self.settings = settings
        share = capacity_tokens // settings.replicas
        self.caches = [PrefixCacheSimulator(share, mode=mode, page_size=page_size)
                       for _ in range(settings.replicas)]
        self.view = SentPrefixView(settings.replicas, share) if settings.router == "prefix" else None
        urls = [f"sim://replica-{index}" for index in range(settings.replicas)]
        self.router = Router(urls, RouterConfig(policy=settings.router), view=self.view)
        self._in_flight: deque[str] = deque()
        self._requests = [0] * settings.replicas
        self._prompt = [0] * settings.replicas
        self._cached = [0] * settings.replicas
        self._reasons: dict[str, int] = {}
        self._count = 0

    def _decide(self, tokens: np.ndarray, key: str | None, sticky: bool) -> tuple[Any, Any, str]:
        from cpmemory.routing.prefix import token_blocks
        from cpmemory.routing.router import conversation_affinity_key

        key = key if key is not None else f"request-{self._count}"
        affinity_key = conversation_affinity_key("bench", key)
        prompt = token_blocks(tokens, self.settings.block_size) if self.view is not None else None
        return self.router.choose(affinity_key, prompt=prompt, sticky=sticky), prompt, affinity_key

    def run(self, tokens: Sequence[int] | np.ndarray, key: str | None = None, sticky: bool = False) -> int:
        """Route one prompt, serve it on the chosen replica's cache, return its cached tokens. O(tokens).

        Args:
            tokens: the prompt's token ids.
            key: its conversation (default: a fresh key per request, every request its own conversation).
            sticky: the request carries its conversation's history (a later turn): keep the conversation's replica.
        """
        array = np.asarray(tokens, dtype=np.int64)
        decision, prompt, affinity_key = self._decide(array, key, sticky)
        self._count += 1
        self.router.begin(decision.url)
        self.router.record(affinity_key, decision, prompt, sticky=True)
        self._in_flight.append(decision.url)
        if len(self._in_flight) >= self.settings.concurrency:
            self.router.end(self._in_flight.popleft())
        cached = self.caches[decision.index].run(array)
        self._requests[decision.index] += 1
        self._prompt[decision.index] += len(array)
        self._cached[decision.index] += cached
        self._reasons[decision.reason] = self._reasons.get(decision.reason, 0) + 1
        return cached

    def peek(self, tokens: Sequence[int] | np.ndarray, key: str | None = None, sticky: bool = False) -> int:
        """Cached tokens ``run`` would report now on the replica the router would pick. Changes nothing."""
        array = np.asarray(tokens, dtype=np.int64)
        decision, _, _ = self._decide(array, key, sticky)
        return int(self.caches[decision.index].peek(array))

    @property
    def used_tokens(self) -> int:
        """Tokens held by every replica."""
        return sum(cache.used_tokens for cache in self.caches)

    def report(self) -> FleetReport:
        """Figures so far."""
        figures = tuple(ReplicaFigures(r, p, c) for r, p, c in zip(self._requests, self._prompt, self._cached))
        return FleetReport(figures, dict(self._reasons))


def replay_prompts(prompts: Iterable[Sequence[int]], capacity_tokens: int, settings: FleetSettings = FleetSettings(),
                   *, keys: Iterable[str | None] | None = None, mode: SimulatorMode = "radix") -> FleetReport:
    """Run a stream of prompts (token ids, arrival order) through a fresh fleet; return its report.

    ``keys`` names each prompt's conversation (a repeated key after its first prompt is a later turn: sticky).
    """
    fleet = ReplicaFleet(capacity_tokens, settings, mode=mode)
    seen: set[str] = set()
    key_list = list(keys) if keys is not None else None
    for index, tokens in enumerate(prompts):
        key = key_list[index] if key_list is not None else None
        fleet.run(tokens, key=key, sticky=key is not None and key in seen)
        if key is not None:
            seen.add(key)
    return fleet.report()
