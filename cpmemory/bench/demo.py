"""``cpmemory demo``: the embedded default (in-memory store, built-in simulator) end to end, in seconds.

A seeded synthetic workload of several concurrent multi-turn conversations over one shared corpus (Zipf
popularity; each later turn re-retrieves some blocks of its earlier turns) is replayed twice on the same simulated
prefix cache: ``original`` (retrieval order, first come first served, no de-duplication) and ``cpmemory`` (the
planner's order and schedule, prompts built by ``CpMemory.prepare``/``commit`` with de-duplication and
annotations). Every prompt is checked with ``check_no_loss``.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import typer

DEMO_SESSIONS = 24
DEMO_TURNS = 4
DEMO_BLOCKS = 8
DEMO_CORPUS = 150
DEMO_CAPACITY = "20%"


def run_demo(seed: int = 0) -> dict[str, Any]:
    """Run the demo workload and return its figures (see module docstring). Deterministic apart from timings."""
    from cpmemory.bench.loaders import load_synthetic
    from cpmemory.bench.replay import ReplaySettings, run_replay

    started = time.perf_counter()
    trace = load_synthetic(requests=DEMO_SESSIONS * DEMO_TURNS, blocks_per_request=DEMO_BLOCKS,
                           corpus_size=DEMO_CORPUS, seed=seed, turns_per_session=DEMO_TURNS, repeat_fraction=0.4)
    report = run_replay(trace, ReplaySettings(capacity=DEMO_CAPACITY, strategies=("original", "cpmemory")))
    figures = report.to_json()
    original, ours = figures["strategies"]["original"], figures["strategies"]["cpmemory"]
    figures.update(
        workload="demo",
        seed=seed,
        sessions=DEMO_SESSIONS,
        turns_per_session=DEMO_TURNS,
        prefill_reduction=round(1 - ours["prefill_tokens"] / original["prefill_tokens"], 4)
        if original["prefill_tokens"] else 0.0,
        seconds=round(time.perf_counter() - started, 2),
    )
    return figures


def _table(figures: dict[str, Any]):
    from rich.table import Table

    original, ours = figures["strategies"]["original"], figures["strategies"]["cpmemory"]
    table = Table(title=f"cpmemory demo: {figures['sessions']} conversations x {figures['turns_per_session']} turns, "
                        f"cache {figures['capacity_tokens']:,} tokens (seed {figures['seed']})")
    table.add_column("")
    table.add_column("original", justify="right")
    table.add_column("cpmemory", justify="right", style="bold")
    rows = (("prefix-cache hit rate", "hit_rate", lambda v: f"{100 * v:.1f}%"),
            ("prompt tokens", "prompt_tokens", lambda v: f"{v:,}"),
            ("prefilled tokens", "prefill_tokens", lambda v: f"{v:,}"),
            ("tokens removed by dedup", "dedup_tokens_saved", lambda v: f"{v:,}"),
            ("tokens added by annotations", "annotation_tokens", lambda v: f"{v:,}"),
            ("middleware p50 / request", "overhead_p50_ms", lambda v: f"{v:.2f} ms"),
            ("no-loss violations", "no_loss_violations", str))
    for title, key, fmt in rows:
        table.add_row(title, fmt(original[key]), fmt(ours[key]))
    table.caption = (f"prefilled tokens -{100 * figures['prefill_reduction']:.1f}%; bounds: MST "
                     f"{100 * figures['mst_bound_hit_rate']:.1f}%, dedup {figures['dedup_bound_tokens']:,} tokens; "
                     f"{figures['seconds']} s")
    return table


def command(
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic workload."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run the embedded default end to end and compare with the original order."""
    from rich.console import Console

    from cpmemory.bench.report import json_line

    figures = run_demo(seed)
    if json_output:
        sys.stdout.write(json_line(figures) + "\n")
    else:
        Console(width=120).print(_table(figures))
