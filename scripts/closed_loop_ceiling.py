#!/usr/bin/env python3
"""How much a closed loop of C clients can cache at best, on the cross-session trace ``bench serve`` replays.

In a closed loop of C clients the proxy never holds more than C questions: question ``j`` of the arrival order is
sent only after ``j - C`` questions have finished, so at most C questions are there to choose from. This script
bounds what block orders and schedules can cache under that rule, first in a cache that never evicts (one cache
holding everything: an upper bound for any number of replicas and any routing), then in the replicas' caches, at
block granularity (a prompt is the system prompt, then its blocks, then the question):

* ``relaxation (upper bound)``: each question finds cached at most its largest block overlap, in tokens, with one
  question that may be served before it (any question less than C later in the arrival order: the closed loop's
  choice set), plus the system prompt. Every schedule and order cache no more than this: a cached prefix is a
  prefix of one earlier prompt, so its blocks are blocks both questions hold;
* ``online orders, arrival order``: the shipped online orderer (``CpMemory.prepare``), questions as they arrive;
* ``planned orders, arrival order``: the block orders of the offline plan of all the questions (it knows the
  future), questions as they arrive;
* ``offline plan (burst)``: the plan's orders and schedule, no closed loop (what a held burst can do);
* the same orders with eviction: ``--replicas`` vLLM caches of each ``--caches`` size (LRU, 128-token pages), one
  question at a time, each to the replica with its longest cached prefix (ties: the one that computed fewer).
  With eviction also ``online / planned orders, best of C (greedy)``: at each step, of the questions the closed loop
  lets in (arrival index below the questions served + C), the one with the longest cached prefix on any replica: a
  schedule a closed loop allows, not the best one.

In a cache that never evicts the schedule changes nothing: a block at depth d of the trie of the orders sent is
computed once, by the first question through it, and found cached by every later one, in any order. So the closed
loop's narrow choice costs nothing there; what it costs on real replicas comes from eviction (a cache of a few
prompts evicts a block before the next question that needs it arrives) and from the questions' split over replicas.

For each it prints the cached share and the prefill ratio against the original's tokens computed, the figure the
closed loop's TTFT follows on saturated replicas (docs/bench-serve.md). No engine needed.

usage: scripts/closed_loop_ceiling.py [--workload locomo_sessions] [--requests 64] [--concurrency 8 64]
                                      [--original-cached 29184]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from cpmemory.bench.loaders import load_workload
from cpmemory.bench.serve_run import ServeSettings, select_jobs
from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.core.planner import plan_batch
from cpmemory.facade import CpMemory
from cpmemory.session.config import DEFAULT_SYSTEM_PROMPT


def cached_in_order(orders, schedule, size, system):
    """Tokens found cached serving ``orders`` (block keys) in ``schedule`` through a cache that never evicts."""
    trie: dict = {}
    total, seen_system = 0, False
    for index in schedule:
        node, found, hit = trie, system if seen_system else 0, True
        seen_system = True
        for key in orders[index]:
            if hit and key in node:
                found += size[key]
            else:
                hit = False
            node = node.setdefault(key, {})
        total += found
    return total


def cached_on_replicas(orders, schedule, size, system, question, capacity, replicas, choose=0):
    """Tokens found cached serving ``orders`` one at a time over ``replicas`` vLLM caches of ``capacity`` tokens
    (LRU, 128-token pages): each question goes to the replica with its longest cached prefix, ties to the one that
    has computed fewer tokens (the proxy's prefix router, in a model). The questions go in ``schedule``; with
    ``choose`` = C > 0, each step instead serves, of the questions a closed loop of C clients lets in (arrival index
    below served + C), the one with the longest cached prefix on any replica (greedy)."""
    starts, offset = {}, system
    for key in size:
        starts[key], offset = offset, offset + size[key]

    def build(index):
        parts = [np.arange(system)]
        parts += [np.arange(starts[key], starts[key] + size[key]) for key in orders[index]]
        parts.append(np.arange(offset + 100_000 * index, offset + 100_000 * index + question[index]))
        return np.concatenate(parts)

    prompts = [build(index) for index in range(len(orders))]  # built once: the greedy pick peeks each many times

    caches = [PrefixCacheSimulator(capacity, mode="vllm", page_size=128) for _ in range(replicas)]
    computed, total, served, waiting, pending = [0] * replicas, 0, 0, [], list(schedule)
    while pending or waiting:
        if choose:
            while pending and pending[0] < served + choose:
                waiting.append(pending.pop(0))
            index = max(waiting, key=lambda i: (max(cache.peek(prompts[i]) for cache in caches), -i))
            waiting.remove(index)
        else:
            index = pending.pop(0)
        prompt = prompts[index]
        replica = max(range(replicas), key=lambda r: (caches[r].peek(prompt), -computed[r]))
        found = caches[replica].run(prompt)
        computed[replica] += len(prompt) - found
        total += found
        served += 1
    return total


def relaxation(keys, size, system, concurrency):
    """Sum over questions of the largest token overlap with one question the closed loop may serve before it."""
    total = 0
    sets = [set(k) for k in keys]
    for index, own in enumerate(sets):
        allowed = range(min(len(sets), index + concurrency))
        best = max((sum(size[key] for key in own & sets[other]) for other in allowed if other != index), default=0)
        total += best + (system if index else 0)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="locomo_sessions")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    parser.add_argument(
        "--caches",
        type=int,
        nargs="+",
        default=[17_408, 34_816],
        help="tokens a replica for the rows with eviction (the bench replicas: 17,408)",
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "data"))
    parser.add_argument(
        "--original-cached",
        type=int,
        default=29_184,
        help="the original's cached tokens (default: the prefix-cache model at 17,408 tokens a "
        "replica, scripts/serve_ceiling.py; the real replicas measure 18-28k)",
    )
    parser.add_argument(
        "--model-dir", default="/root/.cache/cpmemory/wide-model", help="the bench replicas' model (tokenizer)"
    )
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    trace = load_workload(args.workload, args.data_dir)
    settings = ServeSettings(engines=("x",), requests=args.requests, concurrency=1, max_turns=1)
    jobs = [job for session in select_jobs(trace, settings, "ceiling") for job in session]
    keys = [list(job.prepared.keys) for job in jobs]
    size = {key: count(block.text) for job in jobs for key, block in zip(job.prepared.keys, job.prepared.blocks)}
    system = count(DEFAULT_SYSTEM_PROMPT)
    prompt = sum(system + sum(size[key] for key in k) + count(job.request.query) for k, job in zip(keys, jobs))

    memory = CpMemory()
    online = []
    for job in jobs:
        turn = memory.prepare(job.conversation, job.request.query, list(job.prepared.blocks))
        memory.commit(turn, "a short answer")
        key_of = {block.id: key for block, key in zip(job.prepared.blocks, job.prepared.keys)}
        online.append([key_of[block_id] for block_id in turn.prompt_order])
    plan = plan_batch(keys, token_counts=size)
    arrival = list(range(len(jobs)))

    def row(name, cached):
        share = cached / prompt
        ratio = (prompt - args.original_cached) / max(1, prompt - cached)
        table.add_row(name, f"{cached:,}", f"{share:.1%}", f"{ratio:.2f}x")

    table = Table(
        title=f"{args.workload}, {len(jobs)} questions, {prompt:,} prompt tokens; cache never evicts; "
        f"ratio against the original's {args.original_cached:,} cached"
    )
    for column in ("schedule and orders", "cached tokens", "share", "prefill ratio"):
        table.add_column(column, justify="left" if column.startswith("schedule") else "right")
    row("online orders, arrival order", cached_in_order(online, arrival, size, system))
    row("planned orders, arrival order", cached_in_order(plan.contexts, arrival, size, system))
    for concurrency in args.concurrency:
        row(f"relaxation C={concurrency} (upper bound)", relaxation(keys, size, system, concurrency))
    row("offline plan (burst): orders and schedule", cached_in_order(plan.contexts, plan.order, size, system))
    question = [count(job.request.query) for job in jobs]
    for capacity in args.caches:
        label = f"{args.replicas} caches of {capacity:,}"
        for name, orders, schedule in (
            ("online orders, arrival order", online, arrival),
            ("planned orders, arrival order", plan.contexts, arrival),
            ("offline plan (burst)", plan.contexts, plan.order),
        ):
            found = cached_on_replicas(orders, schedule, size, system, question, capacity, args.replicas)
            row(f"{label}: {name}", found)
        for concurrency in args.concurrency:
            for name, orders in (("online", online), ("planned", plan.contexts)):
                found = cached_on_replicas(
                    orders, arrival, size, system, question, capacity, args.replicas, choose=concurrency
                )
                row(f"{label}: {name} orders, best of C={concurrency} (greedy)", found)
    Console().print(table)


if __name__ == "__main__":
    main()
