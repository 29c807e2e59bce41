"""What scheduling inside a window adds to the online path (``bench replay --online --window W``).

Usage::

    .venv/bin/python scripts/window_ceiling.py [multihop locomo synthetic] [--capacity 20%] [--windows 8 32 128]

Each row replaces ``OnlineOrderer.plan_window`` (what ``CpMemory.release_order`` runs for the proxy's
hold-and-release queue) and runs the product's online replay exactly as ``bench replay --online`` does; it prints
the product's gain share (hit rate gain over online ``original`` / the offline planner's gain, same run). Rows:

* ``shipped``: the online orderer over the window, arrival order;
* ``dfs schedule``: the same block orders, the requests run depth-first over the window's trie of those orders;
* ``plan_batch``: the offline planner over the window alone (its block orders and schedule; blind to what was sent);
* ``best of both``: per window, whichever of ``shipped`` and ``plan_batch`` finds more recency-weighted tokens along
  its own orders in the online trie (each request against the trie with the earlier ones of its window recorded).
"""
from __future__ import annotations

import argparse
from collections.abc import Hashable, Sequence
from pathlib import Path
from unittest import mock

from rich.console import Console
from rich.table import Table

from cpmemory.bench.loaders import load_workload
from cpmemory.bench.online import run_online
from cpmemory.bench.replay import (
    ReplaySettings,
    original_contents,
    prepare_requests,
    resolve_capacity,
    run_replay,
    system_prompt_for,
    unique_tokens,
)
from cpmemory.core.online import RECENCY_SCALE, OnlineOrderer
from cpmemory.core.planner import plan_batch

SHIPPED = OnlineOrderer.plan_window
Plan = tuple[list[int], list[list[Hashable]]]


def dfs_schedule(self: OnlineOrderer, contexts: Sequence[Sequence[Hashable]], sizes: Sequence[Sequence[float]]) -> Plan:
    _, orders = SHIPPED(self, contexts, sizes)
    node_ids: dict[tuple[Hashable, ...], int] = {}  # trie node -> first-seen rank (siblings in arrival order)
    paths = []
    for order in orders:
        path = [node_ids.setdefault(tuple(order[: depth + 1]), len(node_ids)) for depth in range(len(order))]
        paths.append(path)
    return sorted(range(len(orders)), key=lambda position: paths[position]), orders


def window_plan(self: OnlineOrderer, contexts: Sequence[Sequence[Hashable]], sizes: Sequence[Sequence[float]]) -> Plan:
    for keys in contexts:
        self.observe(keys)
    return _plan(contexts, sizes)


def _plan(contexts: Sequence[Sequence[Hashable]], sizes: Sequence[Sequence[float]]) -> Plan:
    weights = {key: size for keys, sized in zip(contexts, sizes) for key, size in zip(keys, sized)}
    plan = plan_batch([list(keys) for keys in contexts], token_counts=weights)
    return list(plan.order), [list(order) for order in plan.contexts]


def best_of_both(self: OnlineOrderer, contexts: Sequence[Sequence[Hashable]], sizes: Sequence[Sequence[float]]) -> Plan:
    shipped = SHIPPED(self, contexts, sizes)
    planned = _plan(contexts, sizes)
    size_of = [dict(zip(keys, sized)) for keys, sized in zip(contexts, sizes)]
    return planned if _trie_tokens(self, planned, size_of) > _trie_tokens(self, shipped, size_of) else shipped


def _trie_tokens(orderer: OnlineOrderer, plan: Plan, size_of: list[dict[Hashable, float]]) -> float:
    """Recency-weighted tokens each request finds along its order in the trie, the earlier ones recorded (undone)."""
    schedule, orders = plan
    total = 0.0
    with orderer.tentatively() as record:
        for position in schedule:
            node = orderer._root
            for key in orders[position]:
                child = node.children.get(key)
                if child is None:
                    break
                total += size_of[position][key] / (1.0 + (orderer._clock - child.last) / RECENCY_SCALE)
                node = child
            record(orders[position])
    return total


ROWS = {"shipped": SHIPPED, "dfs schedule": dfs_schedule, "plan_batch": window_plan, "best of both": best_of_both}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["multihop", "locomo", "synthetic"])
    parser.add_argument("--capacity", default="20%")
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    args = parser.parse_args()
    console = Console(width=140)
    for workload in args.workloads:
        trace = load_workload(workload, args.data_dir)
        settings = ReplaySettings(capacity=args.capacity, strategies=("original", "cpmemory"))
        offline = run_replay(trace, settings).results
        prepared = prepare_requests(trace)
        system_prompt = system_prompt_for(settings)
        contents, _ = original_contents(trace, prepared, system_prompt)
        capacity = resolve_capacity(args.capacity, unique_tokens(contents))
        table = Table(title=f"{workload}, {args.capacity}: product gain share (hit rate) by window planner")
        table.add_column("window planner")
        for window in args.windows:
            table.add_column(f"W={window}", justify="right")
        for name, variant in ROWS.items():
            cells = []
            for window in args.windows:
                with mock.patch.object(OnlineOrderer, "plan_window", variant):
                    report = run_online(trace, prepared, system_prompt, capacity, "radix", None, window, offline,
                                        strategies=("original", "cpmemory"))
                cells.append(f"{report.gain_shares['cpmemory']:.3f} ({report.results['cpmemory'].hit_rate:.1%})")
            table.add_row(name, *cells)
            console.print(f"  {workload}: {name} done", style="dim")
        console.print(table)


if __name__ == "__main__":
    main()
