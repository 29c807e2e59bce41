"""``cpmemory bench replay``: replay one trace through every strategy on the same simulated cache.

The offline replay is the package's (:func:`cpmemory.bench.offline.replay_offline`, prompts from
:mod:`cpmemory.bench.prompts`) given every planner of :mod:`cpmemory_benchmarks.strategies`; ``original+lpm`` gets
its execution order from the longest-prefix-match scheduler. This module adds the bounds
(:mod:`cpmemory_benchmarks.bounds`), the online strategies (``--online``, :mod:`cpmemory_benchmarks.online`), the
simulated replicas (``--replicas``) and the replay of every strategy's prompts on a real engine (``--engine URL``).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from cpmemory.bench import tokenizer
from cpmemory.bench.offline import (
    PlainPromptBuilder,
    Progress,
    ReplaySettings,
    StrategyPlan,
    original_contents,
    prepare_requests,
    replay_offline,
    system_prompt_for,
)
from cpmemory.bench.prompts import load_trace
from cpmemory.bench.results import Bounds, ReplayReport
from cpmemory.bench.simulator import simulator_mode
from cpmemory.bench.trace import Trace
from cpmemory.core import annotations as prompt_format
from cpmemory.core.blocks import content_hash, label_for_hash
from cpmemory.errors import CpMemoryError, InvalidInputError
from cpmemory_benchmarks import bounds
from cpmemory_benchmarks.strategies import PLANNERS, STRATEGIES, LongestPrefixScheduler

ALL_STRATEGIES = ReplaySettings(strategies=STRATEGIES)


def _lpm_order(trace: Trace, prompts: Sequence[list[dict[str, str]]], capacity: int) -> list[int]:
    segments = []
    for messages in prompts:
        row: list[tuple[Any, int]] = []
        for message in messages:
            parts = message["content"].split(prompt_format.SECTION_SEPARATOR)
            row.extend((hash((message["role"], part)), tokenizer.count_tokens(part)) for part in parts)
        segments.append(row)
    return LongestPrefixScheduler(capacity).order(segments, trace.sessions, trace.multi_turn)


def _order_resolver(trace: Trace, settings: ReplaySettings):
    """Fill in an online-scheduled plan's execution order (LPM over the plain prompts, which do not depend on it)."""
    def resolve(name: str, plan: StrategyPlan, capacity: int) -> StrategyPlan:
        if plan.order is not None:
            return plan
        builder = PlainPromptBuilder(system_prompt_for(settings), trace.multi_turn)
        built = [builder.build(r, p, c)["messages"]
                 for r, p, c in zip(trace.requests, prepare_requests(trace), plan.contexts)]
        return replace(plan, order=_lpm_order(trace, built, capacity))

    return resolve


def run_replay(trace: Trace, settings: ReplaySettings = ALL_STRATEGIES,
               progress: Progress | None = None, online_window: int | None = None,
               online_workers: int | None = None, redis_url: str | None = None,
               fleet: Any = None) -> ReplayReport:
    """Replay ``trace`` through every strategy of ``settings`` on the same cache. Deterministic apart from timings.

    A strategy whose optional dependency is missing is reported under ``unavailable``. With ``online_window``,
    the online strategies (:mod:`cpmemory_benchmarks.online`) run too, on the same capacity (``report.online``); the
    offline ``original`` and ``cpmemory`` then always run (the gain share needs them).

    Raises:
        InvalidInputError: an unknown strategy, a bad capacity or window.
    """
    if online_window is not None:
        from cpmemory_benchmarks.online import check_window

        check_window(online_window)
        missing = tuple(name for name in ("original", "cpmemory") if name not in settings.strategies)
        settings = replace(settings, strategies=tuple(settings.strategies) + missing)
    report = replay_offline(trace, settings, PLANNERS, progress, _order_resolver(trace, settings))
    prepared = prepare_requests(trace)
    contents, _prompts = original_contents(trace, prepared, system_prompt_for(settings))
    report.bounds = Bounds(
        oracle_hit_rate=bounds.oracle_hit_rate(contents), mst_bound_hit_rate=bounds.mst_bound_hit_rate(contents),
        dedup_bound_tokens=bounds.dedup_bound_tokens(trace, lambda text: tokenizer.count_tokens(
            prompt_format.format_block(label_for_hash(content_hash(text)), text))))
    if online_window is not None:
        from cpmemory_benchmarks.online import run_online

        report.online = run_online(trace, prepared, system_prompt_for(settings), report.capacity_tokens,
                                   settings.mode, settings.page_size, online_window, report.results,
                                   progress=progress, workers=online_workers, redis_url=redis_url, fleet=fleet)
    return report


def replay_on_engine(report: ReplayReport, url: str, *, model: str = "tiny", transport: Any = None) -> None:
    """Send every strategy's prompts (execution order) to a real engine; keep its TTFT and cached tokens.

    Uses :func:`cpmemory_benchmarks.replay_real.measure` (cache reset before each strategy). Mutates ``report``.
    """
    from cpmemory_benchmarks.replay_real import measure

    for result in report.results.values():
        if result.prompts:
            result.real = dict(measure(result.prompts, url, model=model, transport=transport))


# ---------------------------------------------------------------- command

def _fleet(replicas: int | None, router: str, online: bool) -> Any:
    """``FleetSettings`` for ``--replicas N --router R`` (None without ``--replicas``). Raises InvalidInputError."""
    if replicas is None:
        return None
    if not online:
        raise InvalidInputError("--replicas needs --online (the offline strategies run on one cache)")
    from cpmemory_benchmarks.replicas import FleetSettings, router_name

    return FleetSettings(replicas=replicas, router=router_name(router))


def command(
    trace_file: Path | None = typer.Option(None, "--trace", help="A JSON Lines trace (see docs)."),
    workload: str | None = typer.Option(None, "--workload", help="locomo | mt_rag | multihop | synthetic"),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Data folder (default ../shared/data)."),
    engine: str = typer.Option("sim", "--engine", help="'sim' (built-in simulator) or a vLLM base URL."),
    capacity: str = typer.Option("20%", "--capacity", help="Cache size: tokens, or N% of unique tokens."),
    mode: str = typer.Option("radix", "--mode", help="Simulated cache: radix (SGLang) or vllm."),
    page_size: int | None = typer.Option(None, "--page-size", help="Radix page / vLLM block size in tokens."),
    strategies: str | None = typer.Option(None, "--strategies", help="Comma-separated subset of strategies."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG plot of hit rate and cached tokens."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip malformed trace lines instead of stopping."),
    multi_turn: bool | None = typer.Option(None, "--multi-turn/--independent", help="Override the trace's flag."),
    model: str = typer.Option("tiny", "--model", help="Served model name (with --engine URL)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    online: bool = typer.Option(False, "--online", help="Also replay the online strategies (requests as they arrive)."),
    window: int = typer.Option(1, "--window", help="Online: how many waiting requests are ordered together (>= 1)."),
    workers: int | None = typer.Option(None, "--workers", help="Online: K facades on one Redis, round robin."),
    replicas: int | None = typer.Option(None, "--replicas", help="Online: N simulated replicas of capacity/N each."),
    router: str = typer.Option("prefix", "--router", help="Online with --replicas: prefix (default) or affinity."),
    redis_url: str | None = typer.Option(None, "--redis", help="With --workers: Redis URL (default: a throw-away "
                                         "local redis-server)."),
) -> None:
    """Replay a trace or a real workload through every strategy on the same cache; print a table or JSON."""
    from rich.markup import escape

    from cpmemory.bench import report as report_module
    from cpmemory_benchmarks import replay_report

    err = report_module.stderr_console()
    try:
        trace = load_trace(trace_file, workload, data_dir, skip_bad, multi_turn)
        names = tuple(s.strip() for s in strategies.split(",")) if strategies else STRATEGIES
        if online:
            from cpmemory_benchmarks.online import ONLINE_STRATEGIES, check_window

            check_window(window)
            names += tuple(name for name in ("original", "cpmemory") if name not in names)
        settings = ReplaySettings(capacity=capacity, mode=simulator_mode(mode), page_size=page_size, strategies=names,
                                  keep_prompts=engine != "sim")
        for error in trace.skipped:
            err.print(f"[yellow]skipped[/] {escape(str(error))}", soft_wrap=True)
        total = len(trace.requests) * (len(names) + (len(ONLINE_STRATEGIES) if online else 0))
        with report_module.progress_bar(total, f"replay {trace.name}") as advance:
            result = run_replay(trace, settings, advance, online_window=window if online else None,
                                online_workers=workers, redis_url=redis_url,
                                fleet=_fleet(replicas, router, online))
        if engine != "sim":
            replay_on_engine(result, engine, model=model)
    except (CpMemoryError, ImportError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(code=2) from exc
    if plot is not None:
        replay_report.plot_replay(result, plot)
        if result.online is not None:
            replay_report.plot_online(result, plot.with_name(f"{plot.stem}-online{plot.suffix}"))
    if json_output:
        sys.stdout.write(report_module.json_line(result.to_json()) + "\n")
    else:
        replay_report.print_replay(result)
