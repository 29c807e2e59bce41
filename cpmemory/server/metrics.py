"""Prometheus metrics of the proxy, in a registry owned by one app (no process-global state).

Label values come from small fixed sets (replica index, outcome, fallback kind, block status), never from caller
input, so the number of series is bounded whatever the traffic.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cpmemory.errors import MissingDependencyError
from cpmemory.types import BLOCK_STATUSES

OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
HOLD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
FIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    """Counters and histograms of one proxy app."""

    def __init__(self, replica_count: int) -> None:
        """Create the metrics in a fresh registry. No IO."""
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MissingDependencyError("server", "prometheus-client") from error
        self.registry: Any = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "cpmemory_requests", "Chat requests by replica and outcome", ["replica", "outcome"], registry=registry
        )
        self.cached_tokens = Counter(
            "cpmemory_engine_cached_tokens", "Prompt tokens the engine reported as cached", registry=registry
        )
        self.prompt_tokens = Counter(
            "cpmemory_engine_prompt_tokens", "Prompt tokens the engine reported", registry=registry
        )
        self.tokens_deduplicated = Counter(
            "cpmemory_tokens_deduplicated", "Block tokens replaced by a reference (estimated)", registry=registry
        )
        self.blocks = Counter("cpmemory_blocks", "Blocks by dedup decision", ["status"], registry=registry)
        self.overhead = Histogram(
            "cpmemory_middleware_overhead_seconds", "Proxy time outside engine calls", buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "cpmemory_fallbacks", "Degraded paths: store (pass-through), engine (failover), load (rebalanced), "
            "route_tokenize (no prompt blocks for routing), calibrate (the token estimate's count failed)",
            ["kind"], registry=registry,
        )
        self.memory_counters = Gauge(
            "cpmemory_memory_counter", "The facade's counters (cpmemory.session.counters.FacadeCounters: commits, "
            "commit_failures, late_commits, index_errors, ...)", ["counter"], registry=registry,
        )
        self.healthy_replicas = Gauge("cpmemory_healthy_replicas", "Replicas in rotation", registry=registry)
        self.local_tokenizer = Gauge("cpmemory_local_tokenizer",
                                     "1 when prompts are tokenized in the proxy (--tokenizer, or the engine's own "
                                     "found at start), 0 when each count asks an engine's /tokenize",
                                     registry=registry)
        self.healthy_replicas.set(replica_count)
        self.evictions = Counter("cpmemory_evicted_leaves", "Index leaves removed by reports", registry=registry)
        self.kv_sync = Gauge("cpmemory_kv_sync", "KV-event eviction sync counters per replica", ["replica", "counter"],
                             registry=registry)
        self.route_decisions = Counter(
            "cpmemory_route_decisions", "Routing decisions by replica and reason (affinity: the conversation's or "
            "job's replica; prefix: the longest cached prefix within the load bound; load: load decided; failover: "
            "the first choice was down; fit: cache-fit admission placed a new conversation where it fits)", ["replica", "reason"], registry=registry)
        self.route_cached_share = Histogram(
            "cpmemory_route_cached_share", "Share of the prompt the chosen replica holds, as the router's view sees it",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=registry)
        self.prefix_view_synced = Gauge(
            "cpmemory_route_prefix_view_synced", "1 when the replica's KV events are in sequence (prefix scored), 0 "
            "while it is routed by load only (events lost or missing, until resync)", ["replica"], registry=registry)
        self.prefix_view_events = Gauge(
            "cpmemory_route_prefix_view_events", "Prefix view counters per replica (gaps, missing, resyncs, clears, "
            "batches)", ["replica", "counter"], registry=registry)
        self.kv_sync_failures = Gauge("cpmemory_kv_sync_failures", "Prompt registrations that failed",
                                      registry=registry)
        self.gateway_attributions = Counter(
            "cpmemory_gateway_attributions", "Behind a gateway: turns by the replica that served them, as its KV "
            "events told (unknown: no replica stood out)", ["replica"], registry=registry)
        self._hold_metrics(Counter, Gauge, Histogram)
        self.history_reconciled = Counter(  # cpmemory.session.reconcile
            "cpmemory_history_reconciled", "Turns by how the client's history was used (matched: planned from the "
            "committed transcript; diverged: sent as given; none: no history sent; unchecked: nothing to compare "
            "with during a store outage)", ["outcome"], registry=registry)
        self.history_dropped = Counter(
            "cpmemory_history_dropped", "History left out of prompts by a token budget or the turn window, by unit "
            "(messages, turns)", ["unit"], registry=registry)
        self.fit_admissions = Counter(
            "cpmemory_fit_admissions", "Turns admitted by cache-fit admission, by reason (live: the conversation "
            "was being served; room: its history fits; timeout: it waited max_wait and went over the cache)",
            ["reason"], registry=registry)
        self.fit_waiting_now = Gauge("cpmemory_fit_waiting", "Turns waiting for room in a replica's KV cache",
                                     registry=registry)
        self.fit_wait_seconds = Histogram("cpmemory_fit_wait_seconds", "How long a turn that waited for room waited",
                                          buckets=FIT_BUCKETS, registry=registry)
        self.fit_idle_window_seconds = Gauge(
            "cpmemory_fit_idle_window_seconds", "How long a conversation with nothing in flight keeps its share of "
            "the cache (learnt from the gaps between a turn's answer and the conversation's next turn)",
            registry=registry)

    def _hold_metrics(self, counter: Any, gauge: Any, histogram: Any) -> None:
        """The hold-and-release queue's metrics (cpmemory.server.hold); this object is its observer."""
        registry = self.registry
        self.hold_held = counter("cpmemory_hold_held", "Requests held while the replicas were full",
                                 registry=registry)
        self.hold_waiting = gauge("cpmemory_hold_waiting", "Requests held now", registry=registry)
        self.hold_admitted = gauge("cpmemory_hold_admitted", "Requests admitted whose engine call has not ended",
                                   registry=registry)
        self.hold_tokens = gauge("cpmemory_hold_tokens", "Estimated prompt tokens of the admitted requests whose "
                                 "engine call has not ended (the hold's token bound keeps them within the replicas' KV caches)",
                                 registry=registry)
        self.hold_seconds = histogram("cpmemory_hold_seconds", "How long a held request waited",
                                      buckets=HOLD_BUCKETS, registry=registry)
        self.hold_releases = counter(
            "cpmemory_hold_releases", "Windows of held requests released, by reason (slot: a request ended; "
            "timeout: the oldest waited hold_ms) and order (planner: the window planner ordered it; fcfs: arrival "
            "order, no planner, a planner failure or nothing to order)", ["reason", "order"], registry=registry)
        self.hold_released = counter("cpmemory_hold_released", "Held requests released, by reason", ["reason"],
                                     registry=registry)
        self.hold_cancelled = counter("cpmemory_hold_cancelled", "Held requests whose client went away",
                                      registry=registry)
        self.hold_send_timeouts = counter(
            "cpmemory_hold_send_timeouts", "Released requests sent without waiting any longer for the one before them "
            "in their window (it took more than the send turn's limit): the engine may queue them out of the planned "
            "order", registry=registry)

    # -- FitObserver (cpmemory.server.fit) ------------------------------------------------------------------
    def fit_admitted(self, reason: str, waited_s: float) -> None:
        """A turn was admitted by cache-fit admission."""
        self.fit_admissions.labels(reason=reason).inc()
        if waited_s > 0:
            self.fit_wait_seconds.observe(waited_s)

    def fit_waiting(self, waiting: int) -> None:
        """Turns waiting for room now."""
        self.fit_waiting_now.set(waiting)

    def fit_idle_window(self, seconds: float) -> None:
        """The idle window cache-fit admission uses now."""
        self.fit_idle_window_seconds.set(seconds)

    # -- HoldObserver (cpmemory.server.hold) ----------------------------------------------------------------
    def held(self, waiting: int) -> None:
        """A request started waiting."""
        self.hold_held.inc()
        self.hold_waiting.set(waiting)

    def released(self, reason: str, order: str, waits_s: Sequence[float]) -> None:
        """A window of held requests was released."""
        self.hold_releases.labels(reason=reason, order=order).inc()
        self.hold_released.labels(reason=reason).inc(len(waits_s))
        for wait in waits_s:
            self.hold_seconds.observe(wait)
        self.hold_waiting.set(0)

    def send_timed_out(self) -> None:
        """A released request stopped waiting for the one before it to be sent."""
        self.hold_send_timeouts.inc()

    def cancelled(self, waiting: int) -> None:
        """A held request's client went away."""
        self.hold_cancelled.inc()
        self.hold_waiting.set(waiting)

    def planner_failed(self) -> None:
        """The window planner failed: that window went first come first served."""
        self.fallbacks.labels(kind="hold_planner").inc()

    def observe_blocks(self, statuses: list[str]) -> None:
        """Count one request's block decisions."""
        for status in statuses:
            self.blocks.labels(status=status if status in BLOCK_STATUSES else "other").inc()

    def observe_kv_sync(self, stats: dict[int, Any], failures: int) -> None:
        """Copy the eviction-sync counters of each replica into gauges (called on scrape)."""
        for replica, values in stats.items():
            for name in ("registered", "removed_blocks", "evicted_requests", "evicted_leaves", "resets", "resyncs"):
                self.kv_sync.labels(replica=str(replica), counter=name).set(getattr(values, name, 0))
        self.kv_sync_failures.set(failures)

    def observe_memory(self, counters: dict[str, int]) -> None:
        """Copy the facade's counters into gauges (called on scrape)."""
        for name, value in counters.items():
            self.memory_counters.labels(counter=name).set(value)

    def observe_decision(self, replica: int, reason: str, cached_share: float | None) -> None:
        """Count one routing decision (reason from ``router.ROUTE_REASONS``)."""
        self.route_decisions.labels(replica=str(replica), reason=reason).inc()
        if cached_share is not None:
            self.route_cached_share.observe(cached_share)

    def observe_prefix_view(self, view: Any, replicas: int) -> None:
        """Copy an event view's sync state and counters into gauges (called on scrape)."""
        for replica in range(replicas):
            self.prefix_view_synced.labels(replica=str(replica)).set(1 if view.synced(replica) else 0)
            stats = view.stats(replica)
            for name in ("gaps", "missing", "resyncs", "clears", "batches"):
                self.prefix_view_events.labels(replica=str(replica), counter=name).set(getattr(stats, name, 0))

    def render(self) -> tuple[bytes, str]:
        """Return the exposition body and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
