"""``cpmemory bench accuracy``: does cpmemory change what a real model answers? A paired evaluation.

Every question is asked under every condition (``original``, ``reordered``, ``cpmemory``; see
:mod:`cpmemory_benchmarks.accuracy_prompts`) on the same engine, greedily, with the model's own chat template; each
answer is a line of a JSONL file, and a run resumes from it (:mod:`cpmemory_benchmarks.accuracy_run`). The report
gives each condition's exact match, token F1, gold containment and answer length over the questions answered under
every condition, and each condition's paired difference against ``original`` (mean token-F1 difference with a 95%
bootstrap interval and the Wilcoxon signed-rank p, McNemar's exact test on containment), plus ``cpmemory`` against
``reordered`` (the order annotation's own effect). Turns whose gold evidence reached the model only as a reference to
an earlier turn are also scored apart (``by_reference``). Errors and empty answers are counted, never scored.

Start a real model with ``scripts/real_model.sh up qwen-0.5b`` (docs/guides/real-model.md).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import typer

from cpmemory.bench.loaders import default_data_dir
from cpmemory.bench.report import json_line, progress_bar, stderr_console
from cpmemory_benchmarks import accuracy_data
from cpmemory_benchmarks.accuracy_prompts import BASELINE, CONDITIONS, Prompt, build_prompts
from cpmemory_benchmarks.accuracy_run import (
    DEFAULT_MAX_TOKENS,
    ChatEngine,
    Record,
    RecordFile,
    ask_all,
    latest,
    pending,
    served_model,
)
from cpmemory_benchmarks.accuracy_stats import bootstrap_ci, means, paired, score

ENGINE_ENV = "CPM_REAL_MODEL_URL"
ANNOTATION = "cpmemory-vs-reordered"


def prompts_for(name: str, data_dir: Path, limit: int | None, seed: int = 0) -> list[dict[str, Prompt]]:
    """The prompts of the first ``limit`` questions of a dataset (whole chats), every condition."""
    chats = accuracy_data.load(name, data_dir, seed=seed)
    chosen = accuracy_data.select(chats, limit)
    single_turn = name == "multihop"
    return build_prompts(chosen, plan_over=chats if single_turn else None, via_mem0=name == "locomo")


def _subset(rows: Sequence[Mapping[str, Record]], golds: Mapping[str, Sequence[str]],
            conditions: Sequence[str]) -> dict[str, Any]:
    scores = {c: [score(row[c].answer, golds[row[c].qid]) for row in rows] for c in conditions}
    tokens = {c: [float(row[c].answer_tokens) for row in rows] for c in conditions}
    comparisons: dict[str, Any] = {}
    pairs = [(BASELINE, c, c) for c in conditions if c != BASELINE and BASELINE in conditions]
    if "cpmemory" in conditions and "reordered" in conditions:
        pairs.append(("reordered", "cpmemory", ANNOTATION))
    for first, second, name in pairs:
        comparisons[name] = paired(scores[first], scores[second], tokens[first], tokens[second]).as_json()
        margins = [(_margin(row[first]), _margin(row[second])) for row in rows]
        shifts = [b - a for a, b in margins if a is not None and b is not None]
        if shifts:  # yes/no questions: how far the condition moved the model's Yes-against-No logprob margin
            low, high = bootstrap_ci(shifts)
            comparisons[name].update(yes_margin_diff=round(float(np.mean(shifts)), 4),
                                     yes_margin_ci=[round(low, 4), round(high, 4)], yes_margin_n=len(shifts))
    return {"n": len(rows), "conditions": {c: means(scores[c], tokens[c]) for c in conditions},
            "paired": comparisons}


def _margin(record: Record) -> float | None:
    """A yes/no answer's log-odds of Yes against No (None when either was outside the top logprobs)."""
    if record.yes_logprob is None or record.no_logprob is None:
        return None
    return record.yes_logprob - record.no_logprob


def summarize(prompts: Sequence[Mapping[str, Prompt]], done: Mapping[tuple[str, str, str], Record],
              conditions: Sequence[str] = CONDITIONS) -> dict[str, Any]:
    """One dataset's figures (the issue's shape, plus counts) from its prompts and the latest records."""
    rows: list[dict[str, Record]] = []
    errors = empty = asked = 0
    for by_condition in prompts:
        found = {c: done.get((p.question.dataset, p.question.qid, c)) for c, p in by_condition.items()}
        current = {c: r for c, r in found.items() if r is not None and r.prompt_sha == by_condition[c].sha}
        asked += bool(current)
        errors += sum(1 for r in current.values() if r.error is not None)
        empty += sum(1 for r in current.values() if r.empty)
        if len(current) == len(by_condition) and all(r.ok for r in current.values()):
            rows.append(current)
    golds = {by_condition[BASELINE].question.qid: by_condition[BASELINE].question.golds for by_condition in prompts}
    out = _subset(rows, golds, conditions)
    out.update(questions=len(prompts), asked=asked, errors=errors, empty=empty,
               lost=sum(p.lost for by_condition in prompts for p in by_condition.values()))
    if "cpmemory" in conditions:
        flagged = [row for row in rows if row["cpmemory"].by_reference]
        if flagged:
            out["by_reference"] = _subset(flagged, golds, conditions)
            out["direct"] = _subset([row for row in rows if not row["cpmemory"].by_reference], golds,
                                    conditions)
    kinds = sorted({row[conditions[0]].kind for row in rows})
    if len(kinds) > 1:
        out["by_kind"] = {kind: _subset([row for row in rows if row[conditions[0]].kind == kind], golds,
                                          conditions)
                          for kind in kinds}
    return out


def _table(report: Mapping[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"Answer accuracy on {report['model']} (paired; differences against {BASELINE})")
    for header in ("dataset", "condition", "n", "EM", "F1", "contain", "tokens", "F1 diff [95% CI]",
                   "F1 p", "contain -/+", "McNemar p", "errors", "empty", "lost"):
        table.add_column(header, justify="left" if header in ("dataset", "condition") else "right")
    for name, figures in report["datasets"].items():
        for condition, values in figures["conditions"].items():
            table.add_row(name, condition, str(figures["n"]), *(_fmt(values[k]) for k in ("em", "f1", "contain")),
                          _fmt(values["answer_tokens"], 1), *_diff_cells(figures["paired"].get(condition)),
                          str(figures["errors"]), str(figures["empty"]), str(figures["lost"]))
        note = figures["paired"].get(ANNOTATION)
        if note and note["f1_diff"] is not None:
            table.add_row(name, "annotation effect", str(figures["n"]), "", "", "", "", *_diff_cells(note),
                          "", "", "", style="dim")
    return table


def _diff_cells(diff: Mapping[str, Any] | None) -> list[str]:
    """A paired comparison's cells: F1 difference [CI], its signed-rank p, discordant pairs, McNemar p."""
    if not diff or diff["f1_diff"] is None:
        return ["", "", "", ""]
    low, high = diff["f1_ci"]
    return [f"{diff['f1_diff']:+.3f} [{low:+.3f}, {high:+.3f}]", f"{diff['f1_wilcoxon_p']:.3f}",
            f"{diff['contain_only_original']}/{diff['contain_only_cond']}", f"{diff['mcnemar_p']:.3f}"]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(report: Mapping[str, Any], path: Path) -> bool:
    """Paired token-F1 differences with their intervals, one row per dataset and condition; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels, centres, lows, highs = [], [], [], []
    for name, figures in report["datasets"].items():
        for condition, diff in figures["paired"].items():
            if diff["f1_diff"] is None:
                continue
            labels.append(f"{name} {condition} (n={diff['n']})")
            centres.append(diff["f1_diff"])
            lows.append(diff["f1_diff"] - diff["f1_ci"][0])
            highs.append(diff["f1_ci"][1] - diff["f1_diff"])
    figure, axes = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.2))
    axes.errorbar(centres, range(len(labels)), xerr=[lows, highs], fmt="o", capsize=3)
    axes.axvline(0.0, color="grey", linewidth=0.8)
    axes.axvline(-0.05, color="red", linewidth=0.8, linestyle="--")
    axes.set_yticks(range(len(labels)), labels)
    axes.invert_yaxis()
    axes.set_xlabel("paired token-F1 difference, 95% bootstrap CI (dashed: -0.05)")
    axes.set_title(f"{report['model']}: paired differences", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


async def _run(datasets: Sequence[str], data_dir: Path, urls: Sequence[str], model: str | None, out: Path, limit: int,
               concurrency: int, max_tokens: int, time_limit_s: float | None, summary_only: bool,
               seed: int) -> dict[str, Any]:
    console = stderr_console()
    records = RecordFile(out)
    if model is None:
        if not urls:
            raise typer.BadParameter(f"give --engine (or {ENGINE_ENV}) or --model with --summary-only")
        model = await served_model(urls[0])
    built = {name: prompts_for(name, data_dir, limit, seed) for name in datasets}
    deadline = time.monotonic() + time_limit_s if time_limit_s else None
    if not summary_only:
        if not urls:
            raise typer.BadParameter(f"give --engine (or {ENGINE_ENV}) to ask questions")
        for url in urls[1:]:  # a paired comparison needs one model behind every engine
            if (other := await served_model(url)) != model:
                raise typer.BadParameter(f"{url} serves {other!r}, not {model!r}: every --engine must serve one model")
        engines = [ChatEngine(url, model, max_tokens=max_tokens) for url in urls]
        try:
            for name in datasets:
                todo = pending(built[name], latest(records.load(), model))
                console.print(f"{name}: {len(built[name])} questions, {len(todo)} prompts to ask")
                if not todo:
                    continue
                with progress_bar(len(todo), f"{name} ({model})") as advance:
                    await ask_all(engines, todo, records, concurrency=concurrency, deadline=deadline,
                                  advance=lambda _record: advance(1))
                if deadline is not None and time.monotonic() >= deadline:
                    console.print("time limit reached; the run resumes from its JSONL")
                    break
        finally:
            for engine in engines:
                await engine.aclose()
    done = latest(records.load(), model)
    return {"model": model, "datasets": {name: summarize(built[name], done) for name in datasets}}


def command(
    dataset: list[str] = typer.Option(list(accuracy_data.DATASETS), "--dataset", "-d",
                                      help="Datasets, in this order (multihop, locomo, mt_rag)."),
    engine: list[str] = typer.Option([], "--engine", help=f"An engine's base URL, repeat per replica (default: "
                                     f"${ENGINE_ENV}); a chat's prompts all go to one."),
    model: str = typer.Option(None, "--model", help="The served model name (default: the engine's first)."),
    out: Path = typer.Option(Path("accuracy.jsonl"), "--out", help="The per-question JSONL (resumed when present)."),
    limit: int = typer.Option(300, "--limit", min=1, help="Questions per dataset (whole chats, so a few more)."),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Chats in flight per engine."),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", min=1, help="Answer length cap (tokens)."),
    time_limit: float = typer.Option(None, "--time-limit", help="Stop asking after this many seconds (resumable)."),
    summary_only: bool = typer.Option(False, "--summary-only", help="Report from the JSONL, ask nothing."),
    data_dir: Path = typer.Option(None, "--data-dir", help="The datasets (default ../shared/data)."),
    seed: int = typer.Option(0, "--seed", help="Which chats come first."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    plot_path: Path = typer.Option(None, "--plot", help="Save a plot of the paired differences here."),
) -> None:
    """Answer accuracy with and without cpmemory on a real model (paired, resumable)."""
    unknown = [name for name in dataset if name not in accuracy_data.DATASETS]
    if unknown:
        raise typer.BadParameter(f"unknown dataset(s) {unknown}; choose from {', '.join(accuracy_data.DATASETS)}")
    urls = list(engine) or ([os.environ[ENGINE_ENV]] if os.environ.get(ENGINE_ENV) else [])
    report = asyncio.run(_run(dataset, data_dir or default_data_dir(), urls, model, out, limit, concurrency,
                              max_tokens, time_limit, summary_only, seed))
    if plot_path is not None and not plot(report, plot_path):
        stderr_console().print("matplotlib is not installed: no plot")
    if as_json:
        typer.echo(json_line(report))
    else:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:  # a file or a pipe: the whole table, not squeezed to 80 columns
            console = Console(width=200)
        console.print(_table(report))
