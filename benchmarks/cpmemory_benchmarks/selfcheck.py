"""Seeded multi-turn workload through the facade: overhead, de-duplication savings and the no-loss invariant.

Run ``python -m cpmemory_benchmarks.selfcheck [--conversations N] [--turns T] [--json]``. Every prompt is checked with
``check_no_loss``; the figures are the facade's own cost (in-memory store, no LLM), the share of block characters
not sent, and the number of invariant violations (must be 0).

Workload (MT-RAG-like): a shared corpus with Zipf popularity; each turn retrieves ``k`` blocks, about 40% of them
already retrieved earlier in the conversation; some documents are edited between turns (changed blocks), some share
sentences with others (partial overlap), and some turns are aborted (the LLM call failed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from dataclasses import asdict, dataclass

from cpmemory.core.blocks import Block
from cpmemory.core.invariants import check_no_loss
from cpmemory.facade import CpMemory

SHARED_SENTENCES = 400


@dataclass(frozen=True, slots=True)
class SelfCheckFigures:
    """What one run measured."""

    conversations: int
    turns: int
    blocks: int
    prepare_p50_ms: float
    prepare_p99_ms: float
    commit_p50_ms: float
    check_p50_ms: float
    referenced: int
    partial: int
    changed: int
    chars_sent_ratio: float
    violations: int


def make_corpus(rng: random.Random, size: int) -> list[str]:
    """Documents of 3-8 sentences; about a quarter of the sentences are drawn from a shared pool."""
    shared = [
        f"Shared finding {i}: the measured value stayed within the expected range."
        for i in range(SHARED_SENTENCES)
    ]
    corpus = []
    for doc in range(size):
        sentences = [
            rng.choice(shared)
            if rng.random() < 0.25
            else f"Document {doc} states fact {j} about item {rng.randrange(999)}."
            for j in range(rng.randint(3, 8))
        ]
        corpus.append(" ".join(sentences))
    return corpus


def _retrieve(rng: random.Random, cumulative: list[float], earlier: list[int], k: int) -> list[int]:
    chosen: dict[int, None] = {}
    repeat = min(len(earlier), int(k * 0.4))
    for doc in rng.sample(earlier, repeat):
        chosen[doc] = None
    population = range(len(cumulative))
    while len(chosen) < k:
        for doc in rng.choices(population, cum_weights=cumulative, k=k - len(chosen)):
            chosen[doc] = None
    order = list(chosen)
    rng.shuffle(order)
    return order


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 4) if ordered else 0.0


def run(
    conversations: int = 100, turns: int = 8, k: int = 15, seed: int = 0, *, given_history: bool = False
) -> SelfCheckFigures:
    """Run the workload and return its figures (deterministic decisions; timings are wall-clock).

    With ``given_history`` each turn passes the conversation's transcript as ``history`` (as a proxy client that
    resends its history does) instead of letting the facade read the stored one.
    """
    rng = random.Random(seed)
    corpus = make_corpus(rng, 3000)
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(corpus))))
    mem = CpMemory()
    prepare_s: list[float] = []
    commit_s: list[float] = []
    check_s: list[float] = []
    violations = total_chars = 0
    for conversation in range(conversations):
        earlier: list[int] = []
        edits: dict[int, int] = {}
        for turn in range(turns):
            docs = _retrieve(rng, cumulative, earlier, k)
            if rng.random() < 0.1 and earlier:
                edited = rng.choice(earlier)
                edits[edited] = edits.get(edited, 0) + 1
            blocks = [
                Block(f"doc-{d}", corpus[d] + (f" Edit {edits[d]}." if d in edits else "")) for d in docs
            ]
            total_chars += sum(len(block.text) for block in blocks)
            name = f"conversation-{conversation}"
            history = list(mem.state(name).transcript) if given_history else None
            start = time.perf_counter()
            prepared = mem.prepare(name, f"Question {turn}?", blocks, history=history)
            prepare_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            report = check_no_loss(blocks, prepared.messages)
            check_s.append(time.perf_counter() - start)
            violations += len(report.violations)
            if rng.random() < 0.05:
                mem.abort(prepared)
                continue
            start = time.perf_counter()
            mem.commit(prepared, f"Answer {turn}.")
            commit_s.append(time.perf_counter() - start)
            earlier.extend(d for d in docs if d not in earlier)
    counters = mem.counters.snapshot()
    return SelfCheckFigures(
        conversations=conversations,
        turns=conversations * turns,
        blocks=counters["blocks"],
        prepare_p50_ms=_percentile(prepare_s, 0.5),
        prepare_p99_ms=_percentile(prepare_s, 0.99),
        commit_p50_ms=_percentile(commit_s, 0.5),
        check_p50_ms=_percentile(check_s, 0.5),
        referenced=counters["blocks_referenced"],
        partial=counters["blocks_partial"],
        changed=counters["blocks_changed"],
        chars_sent_ratio=round(1 - counters["dedup_chars_saved"] / max(total_chars, 1), 4),
        violations=violations,
    )


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--given-history", action="store_true", help="pass the transcript as history= each turn"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    figures = run(args.conversations, args.turns, args.k, args.seed, given_history=args.given_history)
    if args.json:
        print(json.dumps(asdict(figures)))
        return
    for name, value in asdict(figures).items():
        print(f"{name:<18}{value}")


if __name__ == "__main__":
    main()
