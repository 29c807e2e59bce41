"""``cpmemory bench plan``: time and memory of the batch planner (``plan_batch``) on a large seeded batch.

The batch is :func:`cpmemory.bench.core_bench.make_workload` (Zipf 1.1 popularity, ``k`` blocks per request, a
fifth near-duplicates). Prints ``{"seconds", "cpu_seconds", "peak_rss_mb", "requests", "k", "saved_share"}``: wall (and CPU)
seconds of ``plan_batch`` (single-threaded: on a shared machine the CPU figure is the steadier one), the process's peak resident memory, and the share of block tokens the plan's trie saves (one
token per block).
"""
from __future__ import annotations

import json
import resource
import time

import typer

from cpmemory.bench.core_bench import WorkloadSpec, make_workload


def run_plan_bench(requests: int, k: int = 15, seed: int = 0) -> dict[str, float]:
    """Plan one seeded batch; return the figures (see the module docstring)."""
    from cpmemory.core.planner import plan_batch, trie_savings
    from cpmemory.core.planner_tree import first_seen_ranks

    contexts = make_workload(WorkloadSpec(contexts=requests, k=k, seed=seed))
    started, cpu_started = time.perf_counter(), time.process_time()
    plan = plan_batch(contexts)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    saved, _ = trie_savings(plan.contexts, {}, first_seen_ranks(contexts))
    total = sum(len(context) for context in contexts)
    return {
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "requests": requests,
        "k": k,
        "saved_share": round(saved / total, 4) if total else 0.0,
    }


def command(
    requests: int = typer.Option(100_000, "--requests", min=1, help="Requests in the batch."),
    k: int = typer.Option(15, "--k", min=1, help="Blocks per request."),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Time plan_batch on a seeded batch; print a table or one JSON object."""
    figures = run_plan_bench(requests, k, seed)
    if json_output:
        print(json.dumps(figures))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cpmemory bench plan: {requests:,} requests of k={k}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    targets = {"seconds": "<= 60 (100K)", "peak_rss_mb": "<= 4096"}
    for name, value in figures.items():
        table.add_row(name, str(value), targets.get(name, ""))
    Console().print(table)
