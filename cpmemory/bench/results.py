"""What a replay measured: the per-strategy figures and the report (``--json``), apart from the replay logic."""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Bounds", "ReplayReport", "StrategyResult"]


@dataclass(slots=True)
class StrategyResult:
    """Figures of one strategy (per-request lists are in execution order; ``request_indices`` names each one's
    request, its position in the trace)."""

    name: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    dedup_tokens_saved: int = 0
    annotation_tokens: int = 0
    overhead_ms: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    cached_per_request: list[int] = field(default_factory=list)
    prompt_per_request: list[int] = field(default_factory=list)
    request_indices: list[int] = field(default_factory=list)
    prompts: list[list[dict[str, str]]] | None = None
    real: dict[str, Any] | None = None
    planning_seconds: float = 0.0

    def record(self, built: dict[str, Any], prompt_tokens: int, cached: int, index: int | None = None) -> None:
        """Add one served request: its prompt size, the cached part, and what its build saved and annotated
        (``index``: its position in the trace, for :meth:`hit_rate_of`)."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached
        self.dedup_tokens_saved += built["dedup_saved"]
        self.annotation_tokens += built["annotation"]
        self.cached_per_request.append(cached)
        self.prompt_per_request.append(prompt_tokens)
        if index is not None:
            self.request_indices.append(index)

    def hit_rate_of(self, requests: Container[int]) -> float:
        """Cached tokens / prompt tokens over the requests whose trace position is in ``requests``, wherever they
        ran in the execution order (0.0 when they hold no prompt tokens).

        Raises:
            ValueError: some served request was recorded without its index.
        """
        if len(self.request_indices) != len(self.cached_per_request):
            raise ValueError(f"{self.name}: {len(self.cached_per_request)} requests served, "
                             f"{len(self.request_indices)} recorded with their index")
        cached = prompt = 0
        for index, hit, size in zip(self.request_indices, self.cached_per_request, self.prompt_per_request):
            if index in requests:
                cached += hit
                prompt += size
        return cached / prompt if prompt else 0.0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        """The per-strategy JSON object."""
        overhead = np.asarray(self.overhead_ms or [0.0])
        out: dict[str, Any] = {
            "hit_rate": round(self.hit_rate, 6),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens": self.prompt_tokens - self.cached_tokens,
            "dedup_tokens_saved": self.dedup_tokens_saved,
            "annotation_tokens": self.annotation_tokens,
            "overhead_p50_ms": round(float(np.percentile(overhead, 50)), 4),
            "overhead_p99_ms": round(float(np.percentile(overhead, 99)), 4),
            "no_loss_violations": len(self.violations),
            "planning_seconds": round(self.planning_seconds, 3),
        }
        if self.real is not None:
            out["real"] = self.real
        return out


@dataclass(frozen=True, slots=True)
class Bounds:
    """Upper bounds on reuse whatever the order (computed by the research replay's ``bounds`` module)."""

    oracle_hit_rate: float
    mst_bound_hit_rate: float
    dedup_bound_tokens: int

    def to_json(self) -> dict[str, Any]:
        """The bounds' keys of the replay's ``--json`` object."""
        return {"oracle_hit_rate": round(self.oracle_hit_rate, 6),
                "mst_bound_hit_rate": round(self.mst_bound_hit_rate, 6),
                "dedup_bound_tokens": self.dedup_bound_tokens}


@dataclass(slots=True)
class ReplayReport:
    """Everything one replay measured."""

    workload: str
    requests: int
    capacity_tokens: int
    unique_tokens: int
    mode: str
    multi_turn: bool
    results: dict[str, StrategyResult]
    unavailable: dict[str, str]
    skipped_lines: list[str] = field(default_factory=list)
    # The research replay (benchmarks/) fills in the bounds and, with --online, its online report (``to_json()``).
    bounds: Bounds | None = None
    online: Any = None

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object (keys as issue 6 specifies, plus a few extras)."""
        return {
            "workload": self.workload,
            "requests": self.requests,
            "capacity_tokens": self.capacity_tokens,
            "strategies": {name: result.summary() for name, result in self.results.items()},
            **(self.bounds.to_json() if self.bounds is not None else {}),
            "unique_tokens": self.unique_tokens,
            "mode": self.mode,
            "multi_turn": self.multi_turn,
            "unavailable": self.unavailable,
            "skipped_lines": self.skipped_lines,
            **({"online": self.online.to_json()} if self.online is not None else {}),
        }
