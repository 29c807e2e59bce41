"""``cpmemory demo``: the embedded default (in-memory store, built-in simulator) end to end, in seconds.

A seeded synthetic workload of several concurrent multi-turn conversations over one shared corpus (Zipf
popularity; each later turn re-retrieves some blocks of its earlier turns; the conversations' turns interleave as
they would arrive) is replayed on a simulated prefix cache three ways:

* ``plain``: retrieval order, first come first served, every block in full -- an engine's prefix cache alone;
* ``online``: each turn through ``CpMemory.prepare`` then ``commit`` as it arrives (de-duplication, the online block
  order, annotations) -- what the adapters and the proxy run;
* ``offline``: the planner given the whole trace in advance (``plan_batch`` orders the blocks and schedules the
  turns, the facade builds the prompts) -- a reference that needs every request before the first runs.

Each runs on two caches: a tight one (a fifth of the workload's distinct tokens, about one and a half prompts) and
one that holds the working set (as many tokens as the largest strategy's prompts together: nothing is ever
evicted, so every reuse a strategy makes possible is a hit). Every prompt is checked with ``check_no_loss``.
The ``--json`` object keeps the offline run on the tight cache at its top level (``strategies``) and carries both
paths under ``online`` and ``offline``, each with its ``tight`` and ``working_set`` caches.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import typer

DEMO_SESSIONS = 24
DEMO_TURNS = 4
DEMO_BLOCKS = 8
DEMO_CORPUS = 150
DEMO_CAPACITY = "20%"

TERMS = (
    ("plain prefix cache", "retrieval order, first come first served, every block in full: the engine alone."),
    ("cpmemory online", "CpMemory.prepare then commit per turn as turns arrive: what adapters and the proxy run."),
    ("offline planner", "the whole trace known first, blocks ordered and turns scheduled by plan_batch: a reference."),
    ("tight cache", "a cache holding a fifth of the workload's distinct tokens (about one and a half prompts)."),
    ("working-set cache", "a cache that never evicts (as large as all the prompts of the longest column)."),
    ("hit rate", "prompt tokens found in the prefix cache / prompt tokens."),
    ("prefilled tokens", "prompt tokens the engine computes (not found in the cache); the change is against plain."),
    ("removed by dedup", "block text not sent again because an earlier turn of the conversation showed it."),
    ("added by annotations", "the reference and order lines cpmemory writes in place of what it removed or moved."),
)


def _trace(seed: int) -> Any:
    from cpmemory.bench.loaders import load_synthetic

    return load_synthetic(requests=DEMO_SESSIONS * DEMO_TURNS, blocks_per_request=DEMO_BLOCKS,
                          corpus_size=DEMO_CORPUS, seed=seed, turns_per_session=DEMO_TURNS, repeat_fraction=0.4)


def run_online(trace: Any, capacity: int, system_prompt: str) -> dict[str, Any]:
    """Replay ``trace`` in arrival order through ``plain`` prompts and the facade's online ``prepare``.

    Each strategy gets a fresh simulated cache of ``capacity`` tokens. Returns ``{"original", "cpmemory"}`` summaries
    (the replay's per-strategy JSON objects). O(requests x prompt tokens).
    """
    from cpmemory.bench.prompts import FacadePromptBuilder, PlainPromptBuilder, chat_tokens, prepare_requests
    from cpmemory.bench.results import StrategyResult
    from cpmemory.bench.simulator import PrefixCacheSimulator
    from cpmemory.core.invariants import check_no_loss

    prepared = prepare_requests(trace)
    plain = PlainPromptBuilder(system_prompt, trace.multi_turn)
    facade = FacadePromptBuilder(system_prompt, trace.multi_turn)
    out = {}
    for name in ("original", "cpmemory"):
        simulator = PrefixCacheSimulator(capacity)
        result = StrategyResult(name)
        for index, (request, item) in enumerate(zip(trace.requests, prepared)):
            started = time.perf_counter()
            if name == "cpmemory":
                built = facade.build_online(request, item)
                result.overhead_ms.append(facade.middleware_ms)
            else:
                built = plain.build(request, item, item.keys)
                result.overhead_ms.append((time.perf_counter() - started) * 1000.0)
            report = check_no_loss(list(item.blocks), built["messages"])
            result.violations.extend(f"request {index}: {v}" for v in report.violations)
            tokens = chat_tokens(built["messages"])
            result.record(built, len(tokens), simulator.run(tokens), index)
        out[name] = result.summary()
    return out


def _reduction(strategies: dict[str, Any]) -> float:
    original, ours = strategies["original"]["prefill_tokens"], strategies["cpmemory"]["prefill_tokens"]
    return round(1 - ours / original, 4) if original else 0.0


def _cache(strategies: dict[str, Any], capacity: int, unique: int) -> dict[str, Any]:
    return {"capacity_tokens": capacity, "working_set_share": round(capacity / unique, 4) if unique else 0.0,
            "strategies": strategies, "prefill_reduction": _reduction(strategies)}


def run_demo(seed: int = 0) -> dict[str, Any]:
    """Run the demo workload and return its figures (see module docstring). Deterministic apart from timings."""
    from cpmemory.bench.offline import ReplaySettings, replay_offline, system_prompt_for

    started = time.perf_counter()
    trace = _trace(seed)
    online: dict[str, Any] = {}
    offline: dict[str, Any] = {}
    figures: dict[str, Any] = {}
    capacity: str | int = DEMO_CAPACITY
    for cache in ("tight", "working_set"):
        settings = ReplaySettings(capacity=capacity, strategies=("original", "cpmemory"))
        report = replay_offline(trace, settings)
        summary = report.to_json()
        if not figures:
            figures = summary  # the tight cache's offline run: the demo's historical top-level keys
        offline[cache] = _cache(summary["strategies"], report.capacity_tokens, report.unique_tokens)
        strategies = run_online(trace, report.capacity_tokens, system_prompt_for(settings))
        online[cache] = _cache(strategies, report.capacity_tokens, report.unique_tokens)
        # The next cache holds every prompt token any column sent: it never evicts.
        capacity = max(column["prompt_tokens"] for column in (*summary["strategies"].values(), *strategies.values()))
    figures.update(
        workload="demo",
        seed=seed,
        sessions=DEMO_SESSIONS,
        turns_per_session=DEMO_TURNS,
        prefill_reduction=offline["tight"]["prefill_reduction"],
        online=online,
        offline=offline,
        seconds=round(time.perf_counter() - started, 2),
    )
    return figures


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def _prefill(strategies: dict[str, Any], name: str) -> str:
    value = strategies[name]["prefill_tokens"]
    if name == "original":
        return f"{value:,}"
    return f"{value:,} ({-100 * _reduction({'original': strategies['original'], 'cpmemory': strategies[name]}):+.1f}%)"


def _columns(figures: dict[str, Any], cache: str) -> list[dict[str, Any]]:
    """The three columns' strategy summaries on one cache: plain, online cpmemory, offline cpmemory."""
    online, offline = figures["online"][cache]["strategies"], figures["offline"][cache]["strategies"]
    return [online["original"], online["cpmemory"], offline["cpmemory"]]


def _table(figures: dict[str, Any]) -> Any:
    from rich.table import Table

    requests = figures["sessions"] * figures["turns_per_session"]
    table = Table(title=f"cpmemory demo: {figures['sessions']} conversations x {figures['turns_per_session']} turns "
                        f"({requests} requests, seed {figures['seed']})")
    table.add_column("")
    table.add_column("plain prefix cache", justify="right")
    table.add_column("cpmemory online", justify="right", style="bold")
    table.add_column("offline planner", justify="right")
    for cache, title in (("tight", "tight cache"), ("working_set", "working-set cache")):
        tokens = figures["online"][cache]["capacity_tokens"]
        table.add_section()
        table.add_row(f"[italic]{title}: {tokens:,} tokens[/italic]", "", "", "")
        columns = _columns(figures, cache)
        table.add_row("  hit rate", *(_percent(column["hit_rate"]) for column in columns))
        merged = {"original": columns[0], "online": columns[1], "offline": columns[2]}
        table.add_row("  prefilled tokens", *(_prefill(merged, name) for name in ("original", "online", "offline")))
    table.add_section()
    columns = _columns(figures, "tight")
    rows: Sequence[tuple[str, str, Any]] = (
        ("prompt tokens", "prompt_tokens", lambda v: f"{v:,}"),
        ("tokens removed by dedup", "dedup_tokens_saved", lambda v: f"{v:,}"),
        ("tokens added by annotations", "annotation_tokens", lambda v: f"{v:,}"),
        ("middleware p50 / request", "overhead_p50_ms", lambda v: f"{v:.2f} ms"),
        ("no-loss violations", "no_loss_violations", str),
    )
    for title, key, fmt in rows:
        table.add_row(title, *(fmt(column[key]) for column in columns))
    table.caption = f"in brackets: against plain; the last rows do not depend on the cache; {figures['seconds']} s"
    return table


def command(
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic workload."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run the embedded default end to end: plain prefix caching, cpmemory online, the offline planner."""
    from rich.console import Console

    from cpmemory.bench.report import json_line

    figures = run_demo(seed)
    if json_output:
        sys.stdout.write(json_line(figures) + "\n")
    else:
        console = Console(width=120)
        console.print(_table(figures))
        for term, meaning in TERMS:
            console.print(f"[bold]{term}[/bold]: {meaning}", highlight=False)
