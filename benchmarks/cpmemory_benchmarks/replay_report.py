"""The research replay's report: the side-by-side tables (stdout), the hit-rate plots, a markdown row."""
from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from cpmemory.bench.report import _pyplot
from cpmemory.bench.results import ReplayReport


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f}%"


def replay_table(report: ReplayReport) -> Table:
    """The side-by-side table of a replay, best hit rate first, bounds in the caption."""
    table = Table(title=f"{report.workload}: {report.requests} requests, cache {report.capacity_tokens:,} tokens "
                        f"({report.mode}), unique {report.unique_tokens:,}")
    for header in ("strategy", "hit rate", "prompt tokens", "prefilled", "dedup saved", "annotations",
                   "overhead p50 ms", "p99 ms", "no-loss violations"):
        table.add_column(header, justify="left" if header == "strategy" else "right")
    rows = sorted(report.results.items(), key=lambda item: -item[1].hit_rate)
    for name, result in rows:
        s = result.summary()
        table.add_row(name, _pct(s["hit_rate"]), f"{s['prompt_tokens']:,}", f"{s['prefill_tokens']:,}",
                      f"{s['dedup_tokens_saved']:,}", f"{s['annotation_tokens']:,}", f"{s['overhead_p50_ms']:.3f}",
                      f"{s['overhead_p99_ms']:.3f}", str(s["no_loss_violations"]),
                      style="bold" if name == "cpmemory" else None)
    if report.bounds is not None:
        bounds = report.bounds
        table.caption = (f"bounds: position-free {_pct(bounds.oracle_hit_rate)}, MST {_pct(bounds.mst_bound_hit_rate)}"
                         + (f", dedup bound {bounds.dedup_bound_tokens:,} tokens" if report.multi_turn else ""))
    return table


def online_table(report: ReplayReport) -> Table:
    """The online strategies of a replay (``--online``): hit rate, prefill, gain share, overhead, violations (and the
    replicas' load balance with ``--replicas``)."""
    online = report.online
    fleet = getattr(online, "fleet", None)
    where = f"{fleet.replicas} replicas ({fleet.router} router) of" if fleet is not None else "cache"
    table = Table(title=f"{report.workload} online, window {online.window}: offline cpmemory "
                        f"{_pct(online.offline_cpmemory)}, {where} {report.capacity_tokens:,} tokens")
    headers = ["online strategy", "hit rate", "prefilled", "gain share", "2nd half: hit / share", "dedup saved",
               "overhead p50 ms", "p99 ms", "no-loss violations"] + (["load max/mean"] if fleet is not None else [])
    for header in headers:
        table.add_column(header, justify="left" if header == "online strategy" else "right")
    summaries = online.to_json()["strategies"]
    for name, s in sorted(summaries.items(), key=lambda item: -item[1]["hit_rate"]):
        extra = [f"{s['replica_load_max_over_mean']:.3f}"] if fleet is not None else []
        table.add_row(name, _pct(s["hit_rate"]), f"{s['prefill_tokens']:,}", f"{s['gain_share']:.2f}",
                      f"{_pct(s['hit_rate_second_half'])} / {s['gain_share_second_half']:.2f}",
                      f"{s['dedup_tokens_saved']:,}", f"{s['overhead_p50_ms']:.3f}", f"{s['overhead_p99_ms']:.3f}",
                      str(s["no_loss_violations"]), *extra, style="bold" if name == "cpmemory" else None)
    table.caption = ("gain share = (hit - online original) / (offline cpmemory - original), same run; 2nd half: "
                     "the same over the trace's later half of requests (offline cpmemory "
                     f"{_pct(online.offline_cpmemory_second_half)} there)")
    return table


def plot_online(report: ReplayReport, path: Path) -> None:
    """Write a PNG of the online strategies' hit rate over the run (offline cpmemory's total dashed)."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 4.8))
    for name, result in report.online.results.items():
        x, y = windowed_hit_rate(result.cached_per_request, result.prompt_per_request)
        axis.plot(x, 100 * y, label=f"online {name}", linewidth=2.4 if name == "cpmemory" else 1.2)
    axis.axhline(100 * report.online.offline_cpmemory, color="black", linestyle="--", linewidth=1,
                 label="offline cpmemory (total)")
    axis.set(xlabel="requests executed", ylabel="hit rate per window (%)",
             title=f"{report.workload} online (window {report.online.window}), cache {report.capacity_tokens:,} tokens")
    axis.legend(fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_replay(report: ReplayReport, console: Console | None = None) -> None:
    """Print the replay table (and real-engine figures, unavailable strategies) on stdout."""
    console = console or Console(width=150)
    console.print(replay_table(report))
    if report.online is not None:
        console.print(online_table(report))
    for name, result in report.results.items():
        if result.real:
            console.print(f"{name} on the engine: " + ", ".join(f"{k} {v}" for k, v in result.real.items()))
    for name, reason in report.unavailable.items():
        console.print(f"[yellow]{name} not run:[/] {reason}")


def windowed_hit_rate(cached: Sequence[int], prompt: Sequence[int], windows: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Hit rate over consecutive windows of requests: (x = request index at window end, y = hit rate)."""
    cached_array, prompt_array = np.asarray(cached, float), np.asarray(prompt, float)
    edges = np.unique(np.linspace(0, len(cached_array), min(windows, len(cached_array)) + 1).astype(int))
    x, y = [], []
    for start, end in pairwise(edges):
        total = prompt_array[start:end].sum()
        x.append(end)
        y.append(cached_array[start:end].sum() / total if total else 0.0)
    return np.asarray(x), np.asarray(y)


def plot_replay(report: ReplayReport, path: Path) -> None:
    """Write a two-panel PNG: hit rate over the run (windows of requests) and cumulative cached tokens."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, result in report.results.items():
        width = 2.4 if name == "cpmemory" else 1.2
        x, y = windowed_hit_rate(result.cached_per_request, result.prompt_per_request)
        left.plot(x, 100 * y, label=name, linewidth=width)
        right.plot(np.arange(1, len(result.cached_per_request) + 1), np.cumsum(result.cached_per_request) / 1e6,
                   label=name, linewidth=width)
    if report.bounds is not None:
        left.axhline(100 * report.bounds.mst_bound_hit_rate, color="grey", linestyle="--", linewidth=1,
                     label="MST bound (total)")
    left.set(xlabel="requests executed", ylabel="hit rate per window (%)",
             title=f"{report.workload}: hit rate over the run")
    right.set(xlabel="requests executed", ylabel="cumulative cached tokens (millions)",
              title=f"cache {report.capacity_tokens:,} tokens ({report.mode})")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def markdown_row(report_json: dict[str, Any], capacity_label: str) -> str:
    """One markdown table row of a replay JSON (used by benchmarks/bench_results.sh)."""
    strategies = report_json["strategies"]
    names = ("original", "original+lpm", "popularity", "reorder", "reorder+schedule", "contextpilot", "cpmemory")
    cells = [_pct(strategies[name]["hit_rate"]) if name in strategies else "n/a" for name in names]
    return (f"| {report_json['workload']} | {capacity_label} | " + " | ".join(cells)
            + f" | {_pct(report_json['mst_bound_hit_rate'])} | {_pct(report_json['oracle_hit_rate'])} |")
