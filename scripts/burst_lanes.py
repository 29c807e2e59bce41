#!/usr/bin/env python3
"""A planned burst's lanes against what the engines did: rebuild the split plan of a ``bench serve`` burst
(``--concurrency 64 --max-in-flight 1``) and print, lane by lane in the order sent, each request's cached share as
the plan predicts it (the prefix it shares with an earlier request of its lane, over its blocks plus a fixed
question and template) and as its engine reported it (``--per-request`` file). No engine needed.

The proxy admits the first requests at once (one a replica) and holds the rest as one window; the script takes, per
replica, the request answered first as one of those, prepares them in a fresh facade, then plans the others with
``CpMemory.release_plan`` told both replicas' caches, as the proxy's hold does. Where the two columns part, a
request reached its engine out of the planned order or its prefix was evicted first.

usage: scripts/burst_lanes.py PER_REQUEST.jsonl [--strategy cpmemory] [--cache-tokens 34816] [--data-dir DIR]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cpmemory.bench.loaders import load_workload
from cpmemory.core.planner_tree import common_prefix
from cpmemory.facade import CpMemory

TEMPLATE_CHARS = 600
"""Characters of a prompt besides its blocks (system prompt, question, annotations), for the predicted share."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("per_request", type=Path)
    parser.add_argument("--strategy", default="cpmemory")
    parser.add_argument("--cache-tokens", type=int, default=34_816, help="both replicas' KV caches together")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    args = parser.parse_args()
    rows = [row for row in map(json.loads, args.per_request.read_text().splitlines())
            if row["strategy"] == args.strategy and not row.get("error")]
    trace = load_workload("locomo_sessions", args.data_dir)
    requests = {request.session: request for request in trace.requests}
    actual = {row["session"]: row for row in rows}
    by_replica: dict[int, list[dict]] = {}
    for row in rows:
        by_replica.setdefault(row["replica"], []).append(row)
    first = [min(replica_rows, key=lambda row: row["ttft_ms"])["session"] for replica_rows in by_replica.values()]

    def listed(session: str) -> list[dict[str, str]]:
        return [{"id": block.id, "text": block.text} for block in requests[session].blocks]

    memory = CpMemory()
    for session in first:
        memory.commit(memory.prepare(f"c-{session}", requests[session].query, listed(session)), "answer")
    # the clients start in trace order, so the window is held in it
    window = [request.session for request in trace.requests if request.session in actual and request.session not in first]
    plan = memory.release_plan([listed(session) for session in window], cache_tokens=args.cache_tokens,
                               lanes=len(by_replica))
    orders: dict[str, list[str]] = {}
    lanes: dict[int | None, list[str]] = {}
    for position in plan.order:
        session = window[position]
        turn = memory.prepare(f"c-{session}", requests[session].query, listed(session))
        orders[session] = [str(block_id) for block_id in turn.prompt_order]
        memory.commit(turn, "answer")
        lanes.setdefault(plan.lanes[position], []).append(session)
    size = {block.id: len(block.text) for request in requests.values() for block in request.blocks}
    for lane, sessions in lanes.items():
        predicted, reported = [], []
        for index, session in enumerate(sessions):
            shared = max((common_prefix(orders[earlier], orders[session]) for earlier in sessions[:index]), default=0)
            total = sum(size[key] for key in orders[session]) + TEMPLATE_CHARS
            predicted.append(sum(size[key] for key in orders[session][:shared]) / total)
            reported.append(actual[session]["cached_share"])
        replicas = sorted({actual[session]["replica"] for session in sessions})
        print(f"lane {lane} ({len(sessions)} requests, replica {replicas}):")
        print("  planned  " + " ".join(f"{share * 100:3.0f}" for share in predicted))
        print("  engine   " + " ".join(f"{share * 100:3.0f}" for share in reported))
        print(f"  mean cached share: planned {sum(predicted) / len(predicted):.3f}, "
              f"engine {sum(reported) / len(reported):.3f}")


if __name__ == "__main__":
    main()
