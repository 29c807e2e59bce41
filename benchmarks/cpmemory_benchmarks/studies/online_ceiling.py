"""Where the online (W=1) ceiling lies: block orders that know the future, run in arrival order, one at a time.

Usage::

    .venv/bin/python -m cpmemory_benchmarks.studies.online_ceiling [multihop locomo synthetic] [--capacity 20%] [--seeds 2]

Every row runs the trace in arrival order through the same simulated cache as ``bench replay --online`` (plain
prompts, no de-duplication), so only the block order differs. Rows:

* ``original``: relevance order;
* ``online orderer``: ``core.online.OnlineOrderer`` (what ``prepare`` does), causal;
* ``+ oracle match`` (with ``--oracle``; slow for 15 blocks a request): the same, but the path is chosen by asking
  the simulated cache itself (greedy: the next block is the one that extends the cached prefix most), not the
  trie's recency-weighted estimate;
* ``clairvoyant frequency``: the orderer's match, then the blocks left by how often the *rest of the trace*
  retrieves them (token-weighted): popularity known in advance;
* ``offline orders``: each request's block order from ``plan_batch`` over the whole trace (it knows every request),
  run in arrival order instead of the planner's schedule.

With ``--seeds N`` the same rows also run on N shuffles of the arrival order (within each conversation for LoCoMo),
so a difference can be told from the chaos of one order. Prints a table of hit rates and gain shares against the
offline planner (planned orders *and* schedule) of the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cpmemory.bench.loaders import load_workload
from cpmemory.bench.offline import (
    ReplaySettings,
    original_contents,
    replay_offline,
    resolve_capacity,
    system_prompt_for,
    unique_tokens,
)
from cpmemory.bench.prompts import PlainPromptBuilder, chat_tokens, prepare_requests
from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.bench.tokenizer import count_tokens
from cpmemory.core.online import OnlineOrderer
from cpmemory.core.planner import plan_batch
from cpmemory_benchmarks import online


class _Orderer(online._Plain):
    """The shipped online orderer on plain prompts."""

    def __init__(self, context):
        super().__init__(context)
        self.orderer, self.count = OnlineOrderer(), 0

    def sizes(self, index):
        prepared = self.context.prepared[index]
        return {key: float(count_tokens(block.text)) for block, key in zip(prepared.blocks, prepared.keys)}

    def choose(self, index, size):
        return self.orderer.order(list(size), list(size.values()))

    def order(self, index):
        size = self.sizes(index)
        self.orderer.observe(list(size))
        chosen = self.choose(index, size)
        self.orderer.record(chosen, self.count)
        self.count += 1
        return chosen


class _OracleMatch(_Orderer):
    def choose(self, index, size):
        base = super().choose(index, size)
        request, prepared = self.context.trace.requests[index], self.context.prepared[index]
        probe = PlainPromptBuilder(self.context.system_prompt, False)
        path: list[str] = []
        rest, best = list(base), -1
        while rest:
            tried = []
            for position, key in enumerate(rest):
                candidate = path + [key] + [other for other in rest if other != key]
                cached = self.context.simulator.peek(chat_tokens(probe.build(request, prepared, candidate)["messages"]))
                tried.append((cached, -position, key))
            cached, _, key = max(tried)
            if cached <= best:
                break
            best = cached
            path.append(key)
            rest.remove(key)
        return path + [key for key in base if key not in path]


class _Clairvoyant(_Orderer):
    def __init__(self, context):
        super().__init__(context)
        self.future = Counter(key for prepared in context.prepared for key in prepared.keys)

    def choose(self, index, size):
        self.future.subtract(self.context.prepared[index].keys)
        path = self.orderer.match(size)
        rest = [key for key in size if key not in path]
        return path + sorted(rest, key=lambda key: -self.future[key] * size[key])


def _offline_orders(prepared, sizes):
    plan = plan_batch([list(p.keys) for p in prepared], token_counts=sizes)

    class _Planned(online._Plain):
        def order(self, index):
            return list(plan.contexts[index])

    return _Planned


def _shuffled(trace, seed):
    rng = random.Random(seed)
    groups: dict[str, list] = {}
    for request in trace.requests:
        session = str(request.session)
        groups.setdefault(session.split(":")[0] if ":" in session else "", []).append(request)
    requests = []
    for members in groups.values():
        rng.shuffle(members)
        requests += members
    return dataclasses.replace(trace, requests=requests)


def _hit(trace, factory, capacity_setting):
    prepared = prepare_requests(trace)
    settings = ReplaySettings(capacity=capacity_setting)
    system_prompt = system_prompt_for(settings)
    contents, _ = original_contents(trace, prepared, system_prompt)
    capacity = resolve_capacity(capacity_setting, unique_tokens(contents))
    simulator = PrefixCacheSimulator(capacity)
    context = online._Context(trace, prepared, system_prompt, simulator)
    result = online.run_online_strategy("ceiling", trace, prepared, system_prompt, simulator, 1,
                                        strategy=factory(context))
    return result.hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["multihop", "locomo", "synthetic"])
    parser.add_argument("--capacity", default="20%")
    parser.add_argument("--seeds", type=int, default=0)
    parser.add_argument("--oracle", action="store_true", help="add the oracle-match row")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    args = parser.parse_args()
    console = Console(width=140)
    for workload in args.workloads:
        base = load_workload(workload, args.data_dir)
        traces = [base] + [_shuffled(base, seed) for seed in range(args.seeds)]
        offline = replay_offline(base, ReplaySettings(capacity=args.capacity, strategies=("original", "cpmemory")))
        low, high = offline.results["original"].hit_rate, offline.results["cpmemory"].hit_rate
        table = Table(title=f"{workload}, {args.capacity}: W=1 block orders in arrival order "
                            f"(offline planner {high:.1%}, original {low:.1%})")
        table.add_column("orders")
        for number in range(len(traces)):
            table.add_column("trace order" if number == 0 else f"shuffle {number - 1}", justify="right")
        table.add_column("gain share (trace order)", justify="right")
        rows = [("original", lambda trace: online._Plain), ("online orderer", lambda trace: _Orderer),
                ("+ oracle match", lambda trace: _OracleMatch), ("clairvoyant frequency", lambda trace: _Clairvoyant),
                ("offline orders", lambda trace: _offline_orders(
                    prepare_requests(trace),
                    {key: float(count_tokens(block.text)) for p in prepare_requests(trace)
                     for block, key in zip(p.blocks, p.keys)}))]
        if not args.oracle:
            rows = [row for row in rows if row[0] != "+ oracle match"]
        for name, make in rows:
            hits = [_hit(trace, make(trace), args.capacity) for trace in traces]
            share = (hits[0] - low) / (high - low) if high > low else 0.0
            table.add_row(name, *(f"{hit:.1%}" for hit in hits), f"{share:.2f}")
            console.print(f"  {workload}: {name} done", style="dim")
        console.print(table)


if __name__ == "__main__":
    main()
