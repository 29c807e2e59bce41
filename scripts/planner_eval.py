"""Compare block orderings and schedules on real traces with the prefix-cache simulator (PLANNER's own harness).

Usage::

    .venv/bin/python scripts/planner_eval.py [multihop locomo synthetic mt_rag] [--capacity 0.2] [--mode radix]

Each request's prompt is the system prompt, its blocks in the strategy's order (each as ``[label] text``), then the
question, tokenized with :mod:`cpmemory.bench.tokenizer`. Multi-turn traces (MT-RAG) prefix each turn with the
session's history (earlier turns' prompts and answers), identically for every strategy. Capacity is a fraction of the
workload's unique tokens. The official figures come from ``cpmemory bench replay``; this script is the planner's
development harness.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from cpmemory.bench.loaders import load_workload
from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.bench.tokenizer import tokenize_cached
from cpmemory.bench.trace import Trace
from cpmemory.core.blocks import content_hash, label_for_hash
from cpmemory.core.planner import plan_batch

SYSTEM = (
    "You are a helpful assistant. Answer the question using the documents below. Cite documents by their "
    "labels. If the documents do not contain the answer, say so.\n\n"
)

Plan = tuple[list[int], list[list[str]]]


def block_tokens(text: str) -> tuple[int, ...]:
    return tokenize_cached(f"[{label_for_hash(content_hash(text))}] {text}\n\n")


def contexts_of(trace: Trace) -> tuple[list[list[str]], dict[str, str]]:
    texts: dict[str, str] = {}
    contexts = []
    for request in trace.requests:
        keys = []
        for block in request.blocks:
            key = content_hash(block.text)
            texts[key] = block.text
            if key not in keys:
                keys.append(key)
        contexts.append(keys)
    return contexts, texts


def prompts(trace: Trace, plan: Plan, texts: dict[str, str]) -> list[list[int]]:
    """Token lists in execution order (multi-turn: the session's history prefixes each turn)."""
    order, contexts = plan
    system = tokenize_cached(SYSTEM)
    history: dict[str, list[int]] = {}
    prompt_of: dict[int, list[int]] = {}
    for index in sorted(order, key=lambda i: (trace.requests[i].session, trace.requests[i].turn)):
        request = trace.requests[index]
        tokens = list(history.get(request.session, system)) if trace.multi_turn else list(system)
        for key in contexts[index]:
            tokens.extend(block_tokens(texts[key]))
        tokens.extend(tokenize_cached(f"Question: {request.query}\nAnswer:"))
        prompt_of[index] = tokens
        if trace.multi_turn:
            history[request.session] = tokens + list(tokenize_cached(f" {request.answer or 'ok'}\n\n"))
    return [prompt_of[i] for i in order]


def unique_tokens(trace: Trace, texts: dict[str, str]) -> int:
    total = len(tokenize_cached(SYSTEM)) + sum(len(block_tokens(t)) for t in texts.values())
    return total + sum(len(tokenize_cached(f"Question: {r.query}\nAnswer:")) for r in trace.requests)


def original(contexts: list[list[str]], **_: object) -> Plan:
    return list(range(len(contexts))), contexts


def popularity(contexts: list[list[str]], **_: object) -> Plan:
    counts = Counter(key for context in contexts for key in context)
    return list(range(len(contexts))), [sorted(c, key=lambda k: -counts[k]) for c in contexts]


def contextpilot(contexts: list[list[str]], sessions: Sequence[str] | None = None, **_: object) -> Plan:
    from contextpilot.server.live_index import ContextPilot

    if sessions is not None:
        return original(contexts)
    ids = {key: i for i, key in enumerate(dict.fromkeys(k for c in contexts for k in c))}
    keys = {i: key for key, i in ids.items()}
    reordered, indices = ContextPilot(use_gpu=False).reorder([[ids[k] for k in c] for c in contexts])
    planned = [list(c) for c in contexts]
    for position, index in enumerate(indices):
        out = [keys[i] for i in reordered[position]]
        assert sorted(out) == sorted(contexts[index]), "contextpilot output is not a permutation"
        planned[index] = out
    return list(indices), planned


def planner(
    contexts: list[list[str]],
    sessions: Sequence[str] | None = None,
    token_counts: dict[str, int] | None = None,
) -> Plan:
    plan = plan_batch(contexts, sessions=sessions, token_counts=token_counts)
    return plan.order, plan.contexts


STRATEGIES: dict[str, Callable[..., Plan]] = {
    "original": original,
    "popularity": popularity,
    "contextpilot": contextpilot,
    "planner": planner,
}


def _cached_contextpilot(cache_dir: Path | None, name: str) -> Callable[..., Plan]:
    """The contextpilot strategy, memoised on disk per workload (its O(n^2) build takes minutes)."""
    import pickle

    def run(contexts: list[list[str]], **kwargs: object) -> Plan:
        if cache_dir is None:
            return contextpilot(contexts, **kwargs)
        path = cache_dir / f"contextpilot_{name}.pkl"
        if path.is_file():
            return pickle.loads(path.read_bytes())
        plan = contextpilot(contexts, **kwargs)
        cache_dir.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(plan))
        return plan

    return run


def evaluate(
    name: str,
    data_dir: Path,
    capacity: float,
    mode: str,
    chosen: Sequence[str],
    cache_dir: Path | None = None,
) -> None:
    trace = load_workload(name, data_dir)
    contexts, texts = contexts_of(trace)
    sessions = [r.session for r in trace.requests] if trace.multi_turn else None
    token_counts = {key: len(block_tokens(text)) for key, text in texts.items()}
    cap = int(capacity * unique_tokens(trace, texts))
    print(f"{name}: {len(contexts)} requests, {len(texts)} blocks, capacity {cap} tokens ({mode})")
    for strategy in chosen:
        start = time.perf_counter()
        run = _cached_contextpilot(cache_dir, name) if strategy == "contextpilot" else STRATEGIES[strategy]
        plan = run(contexts, sessions=sessions, token_counts=token_counts)
        planned = time.perf_counter() - start
        assert sorted(plan[0]) == list(range(len(contexts)))
        sim = PrefixCacheSimulator(cap, mode=mode)  # type: ignore[arg-type]
        for tokens in prompts(trace, plan, texts):
            sim.run(tokens)
        stats = sim.stats
        print(
            f"  {strategy:<13} hit {stats.hit_rate:6.1%}  prefill {stats.prefill_tokens:>10,}  plan {planned:.2f}s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workloads", nargs="*", default=["multihop", "locomo", "synthetic"])
    parser.add_argument("--capacity", type=float, default=0.2)
    parser.add_argument("--mode", default="radix")
    parser.add_argument("--data-dir", type=Path, default=Path("/work/shared/data"))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--cache-dir", type=Path, default=None, help="memoise contextpilot's plans here")
    args = parser.parse_args()
    for name in args.workloads:
        evaluate(name, args.data_dir, args.capacity, args.mode, args.strategies.split(","), args.cache_dir)


if __name__ == "__main__":
    main()
