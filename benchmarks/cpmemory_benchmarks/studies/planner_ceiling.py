"""Where the planner's ceiling lies: exact optima of sampled sub-batches against the planner and the MST bound.

Usage::

    .venv/bin/python -m cpmemory_benchmarks.studies.planner_ceiling [multihop locomo synthetic] [--sizes 8,10,12] [--samples 20]

For each workload and size k it samples sub-batches of k requests, each around an anchor request: ``near`` takes
the anchor's k-1 most overlapping requests (a tight cluster, the best case for sharing), ``random`` takes k-1 random
requests that share at least one block with the anchor. On each it computes, in block tokens:

* the exact optimum over all block orders (``cpmemory_benchmarks.bounds.exact_trie_optimum``, a subset DP),
* what ``plan_batch`` reuses,
* the MST bound (``mst_block_reuse``: maximum spanning forest of pairwise overlaps).

and prints planner / optimum and optimum / MST, summed over samples. The last table gives the full batch: the
planner's reuse over the MST bound, with the search off and on. Seeded; a run takes a few minutes.
"""

from __future__ import annotations

import argparse
from collections.abc import Hashable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from cpmemory.bench.loaders import load_workload
from cpmemory.bench.tokenizer import tokenize_cached
from cpmemory.bench.trace import Trace
from cpmemory.core.blocks import content_hash, label_for_hash
from cpmemory.core.planner import plan_batch, trie_savings
from cpmemory.core.planner_tree import first_seen_ranks
from cpmemory_benchmarks.bounds import exact_trie_optimum, mst_block_reuse


def block_tokens(text: str) -> tuple[int, ...]:
    """Token ids of a block as a prompt renders it (label line, text, separator)."""
    return tokenize_cached(f"[{label_for_hash(content_hash(text))}] {text}\n\n")


def contexts_of(trace: Trace) -> tuple[list[list[str]], dict[str, str]]:
    """Each request's distinct block keys (content hashes, retrieval order) and the text of every key."""
    texts: dict[str, str] = {}
    contexts = []
    for request in trace.requests:
        keys: list[str] = []
        for block in request.blocks:
            key = content_hash(block.text)
            texts[key] = block.text
            if key not in keys:
                keys.append(key)
        contexts.append(keys)
    return contexts, texts


def planned_reuse(contexts, weights, ratchet_steps=8) -> float:
    plan = plan_batch(contexts, token_counts=weights, ratchet_steps=ratchet_steps)
    return trie_savings(plan.contexts, weights, first_seen_ranks(contexts))[0]


def sample(contexts, weights, size, how, rng):
    sets = [frozenset(c) for c in contexts]
    anchor = int(rng.integers(len(contexts)))
    overlap = np.array([sum(weights[b] for b in sets[anchor] & s) for s in sets], dtype=float)
    overlap[anchor] = -1
    if how == "near":
        others = np.argsort(-overlap, kind="stable")[: size - 1]
    else:
        candidates = np.flatnonzero(overlap > 0)
        others = rng.choice(candidates, min(size - 1, len(candidates)), replace=False)
    return [contexts[anchor]] + [contexts[int(i)] for i in others]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["multihop", "locomo", "synthetic"])
    parser.add_argument("--sizes", default="8,10,12")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()
    sizes = [int(s) for s in args.sizes.split(",")]
    small = Table(title="Sub-batches: planner vs exact optimum vs MST bound (block tokens, summed over samples)")
    for column in ("workload", "k", "sampling", "planner / optimum", "optimum / MST"):
        small.add_column(column, justify="right")
    full = Table(title="Whole batch: reuse over the MST bound (block tokens)")
    for column in ("workload", "planner, SPR only", "planner", "MST bound tokens"):
        full.add_column(column, justify="right")
    for name in args.workloads:
        contexts, texts = contexts_of(load_workload(name, args.data_dir))
        weights: dict[Hashable, float] = {key: len(block_tokens(text)) for key, text in texts.items()}
        for size in sizes:
            for how in ("near", "random"):
                rng = np.random.default_rng(args.seed)
                planned = optimum = mst = 0.0
                for _ in track(range(args.samples), description=f"{name} k={size} {how}", console=console,
                               transient=True):
                    sub = sample(contexts, weights, size, how, rng)
                    planned += planned_reuse(sub, weights)
                    optimum += exact_trie_optimum(sub, weights)
                    mst += mst_block_reuse(sub, weights)
                small.add_row(name, str(size), how, f"{planned / optimum:.1%}", f"{optimum / mst:.1%}")
        mst = mst_block_reuse(contexts, weights)
        full.add_row(name, f"{planned_reuse(contexts, weights, 0) / mst:.1%}",
                     f"{planned_reuse(contexts, weights) / mst:.1%}", f"{mst:,.0f}")
    console.print(small)
    console.print(full)


if __name__ == "__main__":
    main()
