"""The window W each online target needs: the product's gain share at each W, whole trace and second half.

Usage::

    .venv/bin/python -m cpmemory_benchmarks.studies.window_sweep [--workloads multihop locomo synthetic] [--windows 1 8 32 64 128 256]
        [--capacity 20%] [--data-dir DIR] [--shuffle SEED] [--json] [--plot F.png]

Per workload the offline strategies ``original`` and ``cpmemory`` run once (``replay_offline``), then, per W, the online
``original`` and ``cpmemory`` run exactly as ``cpmemory bench replay --online --window W`` runs them
(``run_online``, a fresh cache each): the figures are that command's ``"online"`` object for ``cpmemory``
(``gain_share``, ``gain_share_second_half``; the other online baselines do not change them). The table ends with
the smallest W measured that reaches issue 15's targets (W=1: 0.60 MultiHop-RAG and synthetic, 0.50 LoCoMo;
W=32: 0.75 / 0.60 / 0.75), over the whole trace and over its second half (the cache warm from the first).
``--shuffle SEED`` runs a shuffle of the arrival order instead (as ``cpmemory_benchmarks.studies.online_ceiling --seeds``
shuffles: LoCoMo's questions within their conversation, the conversations in trace order; the others whole).
``--json`` prints one JSON object on stdout (the table then goes to stderr); ``--plot`` draws share against W.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cpmemory.bench.loaders import load_workload
from cpmemory.bench.offline import ReplaySettings, replay_offline, system_prompt_for
from cpmemory.bench.prompts import prepare_requests
from cpmemory.bench.trace import Trace
from cpmemory_benchmarks.online import run_online

# issue 15's gain-share targets per trace: (at W=1, at W=32)
TARGETS = {"multihop": (0.60, 0.75), "locomo": (0.50, 0.60), "synthetic": (0.60, 0.75)}
SHARES = ("gain_share", "gain_share_second_half")


def shuffled(trace: Trace, seed: int) -> Trace:
    """The trace's requests shuffled within each conversation (session ``conv:question``), conversations in order."""
    rng = random.Random(seed)
    groups: dict[str, list[Any]] = {}
    for request in trace.requests:
        session = str(request.session)
        groups.setdefault(session.split(":")[0] if ":" in session else "", []).append(request)
    requests: list[Any] = []
    for members in groups.values():
        rng.shuffle(members)
        requests += members
    return dataclasses.replace(trace, requests=tuple(requests))


def sweep(workload: str, windows: list[int], capacity_spec: str, data_dir: Path | None, progress: Progress,
          log: Console, shuffle: int | None = None) -> dict[str, Any]:
    """The product's online figures at each W on one workload (one offline run shared by every W)."""
    trace = load_workload(workload, data_dir)
    if shuffle is not None:
        trace = shuffled(trace, shuffle)
    requests = len(trace.requests)
    task = progress.add_task(f"{workload}: offline", total=requests * 2 * (1 + len(windows)))
    settings = ReplaySettings(capacity=capacity_spec, strategies=("original", "cpmemory"))
    replay = replay_offline(trace, settings, progress=lambda steps: progress.advance(task, steps))
    prepared, system_prompt, capacity = prepare_requests(trace), system_prompt_for(settings), replay.capacity_tokens
    rows, online = [], {}
    for window in windows:
        progress.update(task, description=f"{workload}: W={window}")
        online = run_online(trace, prepared, system_prompt, capacity, settings.mode, settings.page_size, window,
                            replay.results, strategies=("original", "cpmemory"),
                            progress=lambda steps: progress.advance(task, steps)).to_json()
        ours = online["strategies"]["cpmemory"]
        row = {"window": window, **{key: ours[key] for key in ("hit_rate", "gain_share", "hit_rate_second_half",
                                                                "gain_share_second_half", "no_loss_violations",
                                                                "overhead_p50_ms")}}
        rows.append(row)
        log.print(f"  {workload} W={window}: share {row['gain_share']:.3f} ({row['hit_rate']:.2%}), second half "
                  f"{row['gain_share_second_half']:.3f} ({row['hit_rate_second_half']:.2%})", style="dim")
    progress.remove_task(task)
    original = online["strategies"]["original"]  # first come first served: the same at every W
    out: dict[str, Any] = {
        "requests": requests, "capacity_tokens": capacity,
        "offline_cpmemory_hit_rate": round(replay.results["cpmemory"].hit_rate, 6),
        "offline_cpmemory_hit_rate_second_half": online["offline_cpmemory_hit_rate_second_half"],
        "online_original_hit_rate": original["hit_rate"],
        "online_original_hit_rate_second_half": original["hit_rate_second_half"],
        "windows": rows,
    }
    if workload in TARGETS:
        out["targets"] = dict(zip(("w1", "w32"), TARGETS[workload]))
        out["smallest_window"] = {f"{name}_{share}": smallest_window(rows, share, target)
                                  for name, target in out["targets"].items() for share in SHARES}
    return out


def smallest_window(rows: list[dict[str, Any]], share: str, target: float) -> int | None:
    """The smallest W among ``rows`` whose ``share`` reaches ``target`` (None: none measured does)."""
    return min((row["window"] for row in rows if row[share] >= target), default=None)


def table(results: dict[str, dict[str, Any]], capacity: str) -> Table:
    out = Table(title=f"online cpmemory gain share by W, {capacity}: whole / 2nd half")
    out.add_column("W", justify="right")
    for workload in results:
        out.add_column(workload, justify="right")
    windows = sorted({row["window"] for result in results.values() for row in result["windows"]})
    for window in windows:
        cells = []
        for result in results.values():
            row = next((row for row in result["windows"] if row["window"] == window), None)
            cells.append("" if row is None else f"{row['gain_share']:.3f} / {row['gain_share_second_half']:.3f}")
        out.add_row(str(window), *cells)
    for name, label in (("w1", "W=1 target"), ("w32", "W=32 target")):
        cells = []
        for result in results.values():
            if "targets" not in result:
                cells.append("")
                continue
            found = [result["smallest_window"][f"{name}_{share}"] for share in SHARES]
            cells.append(f"{result['targets'][name]:.2f}: W " + " / ".join("-" if w is None else str(w) for w in found))
        out.add_row(f"{label}: smallest W", *cells, style="bold")
    out.caption = ("share = (hit - online original) / (offline cpmemory - original), same run; second half: the "
                   "trace's later half of requests; '-': no W measured reaches it")
    return out


def plot(results: dict[str, dict[str, Any]], capacity: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    for number, (workload, result) in enumerate(results.items()):
        color = f"C{number}"
        windows = [row["window"] for row in result["windows"]]
        axis.plot(windows, [row["gain_share"] for row in result["windows"]], "o-", color=color,
                  label=f"{workload}, whole trace")
        axis.plot(windows, [row["gain_share_second_half"] for row in result["windows"]], "s--", color=color,
                  alpha=0.7, label=f"{workload}, second half")
    lines: dict[float, list[str]] = {}  # target -> who it is for
    for workload, result in results.items():
        for name, value in result.get("targets", {}).items():
            lines.setdefault(value, []).append(f"{workload} {name.replace('w', 'W=')}")
    windows = sorted({row["window"] for result in results.values() for row in result["windows"]})
    for value, labels in lines.items():
        axis.axhline(value, color="gray", linestyle=":", linewidth=1)
        axis.text(windows[-1], value + 0.005, ", ".join(labels), fontsize=6, color="gray", va="bottom", ha="right")
    ticks = [windows[0]]
    for window in windows[1:]:
        if window >= 2 * ticks[-1]:  # at least a doubling apart: labels do not overlap
            ticks.append(window)
    axis.set_xscale("log", base=2)
    axis.set_xticks(ticks, [str(w) for w in ticks], fontsize=7)
    axis.set(xlabel="window W (requests ordered together)", ylabel="gain share of the offline planner",
             title=f"online cpmemory, {capacity} cache (dotted: issue 15's targets)")
    axis.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["multihop", "locomo", "synthetic"])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--capacity", default="20%")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--shuffle", type=int, default=None, metavar="SEED", help="a shuffle of the arrival order")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (table on stderr)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of gain share against W")
    args = parser.parse_args()
    log = Console(stderr=True, width=140)
    console = log if args.json else Console(width=140)
    results = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=log, transient=True) as progress:
        for workload in args.workloads:
            results[workload] = sweep(workload, sorted(set(args.windows)), args.capacity, args.data_dir, progress,
                                      log, args.shuffle)
    console.print(table(results, args.capacity + ("" if args.shuffle is None else f", shuffle {args.shuffle}")))
    if args.plot is not None:
        plot(results, args.capacity, args.plot)
    if args.json:
        sys.stdout.write(json.dumps({"capacity": args.capacity, "shuffle": args.shuffle, "workloads": results}) + "\n")


if __name__ == "__main__":
    main()
