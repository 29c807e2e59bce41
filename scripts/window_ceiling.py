"""What scheduling inside a window adds to the online path (``bench replay --online --window W``).

Usage::

    .venv/bin/python scripts/window_ceiling.py [multihop locomo synthetic] [--capacity 20%] [--windows 8 32 128]

Each row replaces ``OnlineOrderer.plan_window`` (what ``CpMemory.release_order`` runs for the proxy's
hold-and-release queue, told the cache size) and runs the product's online replay exactly as ``bench replay
--online`` does; it prints the product's gain share (hit rate gain over online ``original`` / the offline planner's
gain, same run). Rows:

* ``online orders``: the online orderer over the window, arrival order (the cache size unused);
* ``dfs schedule``: the same block orders, the requests run depth-first over the window's trie of those orders;
* ``plan_batch``: the offline planner over the window alone (its block orders and schedule; blind to what was sent);
* ``best of both``: per window, whichever of ``online orders`` and ``plan_batch`` finds more recency-weighted tokens
  along its own orders in the online trie (each request against the trie with the earlier ones of its window
  recorded);
* ``window + last 64``: ``plan_batch`` over the window together with the last 64 requests' blocks (the carried
  state), the window's requests in the plan's order with the plan's block orders;
* ``match, then plan``: each request's cached trie path first (as at W=1), then its other blocks in the order the
  window's ``plan_batch`` gave them, arrival order;
* ``by cache size``: the shipped rule, ``plan_batch`` when the window's blocks outgrow the cache (``capacity``),
  else ``online orders``;
* ``by cache size, ratchet 4``: the same with the offline planner's local-search ratchet;
* ``by 0.7 x cache size``, ``by 2 x cache size``: the same rule against a smaller / larger threshold.
"""
from __future__ import annotations

import argparse
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Sequence
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
Contexts = Sequence[Sequence[Hashable]]
Sizes = Sequence[Sequence[float]]


def online_orders(self: OnlineOrderer, contexts: Contexts, sizes: Sizes, capacity: float | None = None) -> Plan:
    return SHIPPED(self, contexts, sizes)  # no capacity: the online orders in arrival order


def dfs_schedule(self: OnlineOrderer, contexts: Contexts, sizes: Sizes, capacity: float | None = None) -> Plan:
    _, orders = SHIPPED(self, contexts, sizes)
    node_ids: dict[tuple[Hashable, ...], int] = {}  # trie node -> first-seen rank (siblings in arrival order)
    paths = []
    for order in orders:
        path = [node_ids.setdefault(tuple(order[: depth + 1]), len(node_ids)) for depth in range(len(order))]
        paths.append(path)
    return sorted(range(len(orders)), key=lambda position: paths[position]), orders


def window_plan(self: OnlineOrderer, contexts: Contexts, sizes: Sizes, capacity: float | None = None) -> Plan:
    for keys in contexts:
        self.observe(keys)
    return _plan(contexts, sizes)


def _plan(contexts: Contexts, sizes: Sizes, ratchet_steps: int = 4) -> Plan:
    weights = {key: size for keys, sized in zip(contexts, sizes) for key, size in zip(keys, sized)}
    plan = plan_batch([list(keys) for keys in contexts], token_counts=weights, ratchet_steps=ratchet_steps)
    return list(plan.order), [list(order) for order in plan.contexts]


_RECENT: weakref.WeakKeyDictionary[OnlineOrderer, deque[tuple[list[Hashable], list[float]]]] = (
    weakref.WeakKeyDictionary())


def with_recent(self: OnlineOrderer, contexts: Contexts, sizes: Sizes, capacity: float | None = None) -> Plan:
    for keys in contexts:
        self.observe(keys)
    recent = _RECENT.setdefault(self, deque(maxlen=64))  # the last requests' blocks and sizes
    carried = list(recent)
    recent.extend((list(keys), list(sized)) for keys, sized in zip(contexts, sizes))
    past = [keys for keys, _ in carried]
    weights = {key: size for keys, sized in [*carried, *zip(contexts, sizes)] for key, size in zip(keys, sized)}
    plan = plan_batch(past + [list(keys) for keys in contexts], token_counts=weights)
    return ([index - len(past) for index in plan.order if index >= len(past)],
            [list(order) for order in plan.contexts[len(past):]])


def match_then_plan(self: OnlineOrderer, contexts: Contexts, sizes: Sizes, capacity: float | None = None) -> Plan:
    for keys in contexts:
        self.observe(keys)
    _, planned = _plan(contexts, sizes)
    orders = [list(keys) for keys in contexts]
    with self.tentatively() as record:
        for position, keys in enumerate(contexts):
            if keys:
                path = self.match(dict(zip(keys, sizes[position])))
                orders[position] = path + [key for key in planned[position] if key not in set(path)]
                record(orders[position])
    return list(range(len(contexts))), orders


def by_cache_size_ratchet(self: OnlineOrderer, contexts: Contexts, sizes: Sizes, capacity: float | None = None) -> Plan:
    if capacity is not None and sum(sum(sized) for sized in sizes) > capacity:
        for keys in contexts:
            self.observe(keys)
        return _plan(contexts, sizes, ratchet_steps=4)
    return SHIPPED(self, contexts, sizes)


def _scaled(factor: float) -> Callable[..., Plan]:  # plan_window against factor x the cache size
    def plan(self: OnlineOrderer, contexts: Contexts, sizes: Sizes, capacity: float | None = None) -> Plan:
        return SHIPPED(self, contexts, sizes, None if capacity is None else factor * capacity)
    return plan


def best_of_both(self: OnlineOrderer, contexts: Contexts, sizes: Sizes, capacity: float | None = None) -> Plan:
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


ROWS = {"online orders": online_orders, "dfs schedule": dfs_schedule, "plan_batch": window_plan,
        "best of both": best_of_both, "window + last 64": with_recent, "match, then plan": match_then_plan,
        "by cache size": SHIPPED, "by cache size, ratchet 4": by_cache_size_ratchet,
        "by 0.7 x cache size": _scaled(0.7), "by 2 x cache size": _scaled(2.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["multihop", "locomo", "synthetic"])
    parser.add_argument("--capacity", default="20%")
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
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
        for name in args.rows:
            variant = ROWS[name]
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
