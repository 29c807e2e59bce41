"""Where ``bench serve``'s time goes: the engines' own counters and the proxy's, read before and after a strategy.

The client sees one number per request (TTFT). The engines split it: vLLM's ``/metrics`` histograms give the time a
request waited in the engine's queue (``request_queue_time``), the time its prefill ran (``request_prefill_time``)
and the engine's own TTFT (arrival at the engine to first token); its counters give the prompt tokens, the tokens
served from the prefix cache, the tokens actually computed during prefill and the preemptions (a running request
evicted for lack of KV cache). The difference of two scrapes is what one strategy's replay did. Client TTFT minus
engine TTFT is what happened before the engine: the proxy's work (prepare, tokenization for routing), the network and
the client's own event loop.

The proxy's ``/metrics`` (``cpmemory serve``) says how it routed (decisions by reason), what fell back (by kind),
how long it spent outside engine calls, and how many KV-sync tokenizations failed.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

# sample name -> short name; a histogram contributes its _sum and _count
ENGINE_SAMPLES = {
    "vllm:time_to_first_token_seconds_sum": "ttft_s", "vllm:time_to_first_token_seconds_count": "requests",
    "vllm:request_queue_time_seconds_sum": "queue_s", "vllm:request_queue_time_seconds_count": "queued",
    "vllm:request_prefill_time_seconds_sum": "prefill_s", "vllm:request_prefill_time_seconds_count": "prefilled",
    "vllm:request_prefill_kv_computed_tokens_sum": "computed_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens", "vllm:prompt_tokens_cached_total": "cached_tokens",
    "vllm:num_preemptions_total": "preemptions",
}
PROXY_SAMPLES = {
    "cpmemory_middleware_overhead_seconds_sum": "overhead_s",
    "cpmemory_middleware_overhead_seconds_count": "overhead_count",
    "cpmemory_kv_sync_failures": "kv_sync_failures",
    "cpmemory_fit_wait_seconds_sum": "fit_wait_s", "cpmemory_fit_wait_seconds_count": "fit_waits",
    "cpmemory_local_tokenizer": "local_tokenizer",
    "cpmemory_fit_idle_window_seconds": "idle_window_s",
    "cpmemory_hold_held_total": "hold_held", "cpmemory_hold_seconds_sum": "hold_wait_s",
    "cpmemory_hold_send_timeouts_total": "hold_send_timeouts",
}
GAUGES = ("local_tokenizer", "idle_window_s")
"""Samples that are states, not counters: a delta keeps the later value, pooled rounds the largest."""

PER_ENGINE = ("prefill_s", "queue_s", "computed_tokens")
"""Engine samples also kept per engine (``NAME@i``, i the position in the scraped URLs): how the work was spread."""

# counters kept per label value: sample name -> (key prefix, label)
GROUPED = {"cpmemory_route_decisions_total": ("route_", "reason"), "cpmemory_fallbacks_total": ("fallback_", "kind"),
           "cpmemory_fit_admissions_total": ("fit_", "reason"),
           "cpmemory_gateway_attributions_total": ("served_on_", "replica"),
           "cpmemory_hold_releases_total": ("holdwin_", "order")}


def totals(text: str, wanted: Mapping[str, str]) -> dict[str, float]:
    """The samples of ``wanted`` in a Prometheus text, summed over label sets, under their short names. Pure."""
    from cpmemory.engines.vllm_admin import parse_metrics

    out: dict[str, float] = {}
    for name, labels, value in parse_metrics(text):
        if name in wanted:
            out[wanted[name]] = out.get(wanted[name], 0.0) + value
        elif name in GROUPED:
            key = GROUPED[name][0] + labels.get(GROUPED[name][1], "?")
            out[key] = out.get(key, 0.0) + value
    return out


async def scrape(urls: Sequence[str], wanted: Mapping[str, str], timeout_s: float = 10.0) -> dict[str, float] | None:
    """``/metrics`` of every URL at once, the ``wanted`` samples summed over them; None if any scrape failed."""
    import httpx

    async def one(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
        try:
            response = await client.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        return totals(response.text, wanted)

    async with httpx.AsyncClient() as client:
        rows = await asyncio.gather(*(one(client, url) for url in urls))
    if any(row is None for row in rows):
        return None
    return combine([row or {} for row in rows])


def combine(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Several servers' samples summed, and those of :data:`PER_ENGINE` also kept per server (``NAME@i``). Pure."""
    summed: dict[str, float] = {}
    for position, row in enumerate(rows):
        for key, value in row.items():
            summed[key] = summed.get(key, 0.0) + value
            if key in PER_ENGINE:
                summed[f"{key}@{position}"] = value
    return summed


def delta(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, float] | None:
    """``after - before`` per key (None when either scrape failed). Pure."""
    if before is None or after is None:
        return None
    return {key: value if key in GAUGES else value - before.get(key, 0.0) for key, value in after.items()}


def add(total: dict[str, float] | None, more: Mapping[str, float] | None, first: bool) -> dict[str, float] | None:
    """Pool two deltas (rounds of one strategy); None stays None once a round could not be read."""
    if more is None or (total is None and not first):
        return None
    out = dict(total or {})
    for key, value in more.items():
        out[key] = max(out.get(key, 0.0), value) if key in GAUGES else out.get(key, 0.0) + value
    return out


def engine_summary(raw: Mapping[str, float] | None) -> dict[str, Any] | None:
    """Means per request (ms) and token totals from a pooled engine delta (see the module docstring)."""
    if raw is None:
        return None

    def mean(total: str, count: str) -> float | None:
        return round(1000.0 * raw[total] / raw[count], 1) if raw.get(count) else None

    engines = sorted({int(key.rsplit("@", 1)[1]) for key in raw if "@" in key})
    per_engine = [{"prefill_s": round(raw.get(f"prefill_s@{i}", 0.0), 2), "queue_s": round(raw.get(f"queue_s@{i}", 0.0), 2),
                   "computed_tokens": int(raw.get(f"computed_tokens@{i}", 0))} for i in engines]
    busy = [row["prefill_s"] for row in per_engine]
    return {"requests": int(raw.get("requests", 0)), "ttft_mean_ms": mean("ttft_s", "requests"),
            "queue_mean_ms": mean("queue_s", "queued"), "prefill_mean_ms": mean("prefill_s", "prefilled"),
            "prompt_tokens": int(raw.get("prompt_tokens", 0)), "cached_tokens": int(raw.get("cached_tokens", 0)),
            "computed_tokens": int(raw.get("computed_tokens", 0)), "preemptions": int(raw.get("preemptions", 0)),
            "per_engine": per_engine,
            "prefill_max_over_mean": round(max(busy) * len(busy) / sum(busy), 3) if busy and sum(busy) > 0 else None}


def proxy_summary(raw: Mapping[str, float] | None) -> dict[str, Any] | None:
    """Route decisions by reason, fallbacks by kind, mean overhead (ms), KV-sync failures (registrations and
    routing tokenizations), cache-fit admissions by reason with their mean wait (ms, over the turns that waited) and
    the waits per request (ms, over every request: what admission adds to the mean TTFT), the idle window it had learnt by
    the end (ms, None before it learnt one), and behind a gateway the turns
    attributed to each replica by its KV events (``unknown``: none stood out), and whether prompts were tokenized
    in the proxy by the end (``local_tokenizer``), from a proxy delta."""
    if raw is None:
        return None
    count = raw.get("overhead_count", 0.0)

    def grouped(prefix: str) -> dict[str, int]:
        return {key[len(prefix):]: int(value) for key, value in sorted(raw.items()) if key.startswith(prefix) and value}

    return {"route_reasons": grouped("route_"), "fallbacks": grouped("fallback_"),
            "overhead_mean_ms": round(1000.0 * raw.get("overhead_s", 0.0) / count, 1) if count else None,
            "kv_sync_failures": int(raw.get("kv_sync_failures", 0)),
            "fit_admissions": {key: value for key, value in grouped("fit_").items() if key not in ("wait_s", "waits")},
            "fit_wait_mean_ms": round(1000.0 * raw.get("fit_wait_s", 0.0) / raw["fit_waits"], 1)
            if raw.get("fit_waits") else None,
            "fit_wait_per_request_ms": round(1000.0 * raw.get("fit_wait_s", 0.0) / count, 1) if count else None,
            "gateway_attributions": grouped("served_on_"),
            "fit_idle_window_ms": round(1000.0 * raw["idle_window_s"], 1) if raw.get("idle_window_s") else None,
            "local_tokenizer": bool(raw.get("local_tokenizer")),
            "hold_held": int(raw.get("hold_held", 0)),
            "hold_wait_per_request_ms": round(1000.0 * raw.get("hold_wait_s", 0.0) / count, 1) if count else None,
            "hold_windows": grouped("holdwin_"),
            "hold_send_timeouts": int(raw.get("hold_send_timeouts", 0))}
