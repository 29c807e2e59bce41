#!/usr/bin/env python3
"""What ``bench serve`` can show at best: prefilled tokens of ``original`` vs ``cpmemory`` under the vLLM prefix-cache
model, for the sessions ``bench serve`` selects, in its interleaving (C sessions round robin), per replica
(the router's rendezvous choice over two replicas), for several KV-cache sizes. No engine needed.

The model runs requests one at a time, so it never sees the blocks that concurrent requests hold: it is an upper
bound on the reuse a concurrent run gets from the same cache. Tokens come from the tiny model's tokenizer
(``tokenizer.json``; the ``tokenizers`` package), answers are a fixed short text (the bench's answers are a few tokens).

usage: scripts/serve_ceiling.py WORKLOAD [--requests 64] [--concurrency 8] [--max-turns 6]
                                [--caches 16384,32768,65536] [--model-dir /root/.cache/cpmemory/tiny-model]
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np

from cpmemory.bench.loaders import load_workload
from cpmemory.bench.replay import plain_user_message
from cpmemory.bench.serve_run import ServeSettings, select_jobs
from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.facade import CpMemory
from cpmemory.routing.router import Router, conversation_affinity_key
from cpmemory.session.config import DEFAULT_SYSTEM_PROMPT

ANSWER = "a short answer"


def round_robin(sessions, concurrency):
    """Jobs in the order C closed-loop clients would send them if every request took the same time."""
    pending, active, order = list(sessions)[::-1], [], []
    while pending or active:
        while pending and len(active) < concurrency:
            active.append(list(pending.pop()))
        for turns in list(active):
            order.append(turns.pop(0))
            if not turns:
                active.remove(turns)
    return order


def prompts(order, multi_turn, strategy):
    """The messages each job sends under ``strategy`` (original: built like DirectClient; cpmemory: the facade)."""
    memory, history, out = CpMemory(), collections.defaultdict(list), []
    for job in order:
        blocks, query = job.prepared.blocks, job.request.query
        if strategy == "original":
            user = plain_user_message(blocks, range(len(blocks)), query)
            messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *history[job.conversation],
                        {"role": "user", "content": user}]
            if multi_turn:
                history[job.conversation] += [messages[-1], {"role": "assistant", "content": ANSWER}]
        else:
            turn = memory.prepare(job.conversation, query, list(blocks))
            memory.commit(turn, ANSWER)
            messages = turn.messages
        out.append(messages)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--caches", default="16384,32768,65536")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--model-dir", default="/root/.cache/cpmemory/tiny-model")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))

    def tokens(messages):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return np.asarray(tokenizer.encode(text + "<|im_start|>assistant\n").ids, dtype=np.int64)

    trace = load_workload(args.workload, args.data_dir)
    settings = ServeSettings(engines=("x",), requests=args.requests, concurrency=args.concurrency,
                             max_turns=args.max_turns)
    order = round_robin(select_jobs(trace, settings, "ceiling"), args.concurrency)
    router = Router([f"http://replica-{i}" for i in range(args.replicas)])
    replicas = [router.choose(conversation_affinity_key("default", job.conversation)).index for job in order]
    built = {name: [tokens(m) for m in prompts(order, trace.multi_turn, name)] for name in ("original", "cpmemory")}
    for capacity in (int(value) for value in args.caches.split(",")):
        row = {"workload": trace.name, "kv_cache_tokens_per_replica": capacity}
        for name, rows in built.items():
            caches = [PrefixCacheSimulator(capacity, mode="vllm", page_size=128) for _ in range(args.replicas)]
            cached = sum(caches[replica].run(t) for replica, t in zip(replicas, rows))
            prompt = sum(len(t) for t in rows)
            row[name] = {"prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens": prompt - cached}
        row["prefill_ratio"] = round(row["original"]["prefill_tokens"] / max(1, row["cpmemory"]["prefill_tokens"]), 3)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
