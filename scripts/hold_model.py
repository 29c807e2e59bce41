#!/usr/bin/env python3
"""What the proxy's hold can cache under overload: windows released whole against a pick per free replica.

A time model of ``bench serve``'s cross-session trace (the LoCoMo questions, whole dialog sessions as blocks, the
wide model's tokenizer) on two replicas. Each replica computes one prompt at a time, one time unit a token it must
compute (the prompt minus its cached prefix in the replica's LRU prefix cache of 128-token pages, as vLLM keeps
it), in the order requests reach it. Questions arrive as a seeded Poisson process at ``--load`` times what the
original serves (two replicas over the original's mean prompt work), or from a closed loop of ``--closed`` clients.
Policies:

* ``original``: relevance order, no hold, each conversation's replica by hash (affinity);
* ``no hold``: the online orders (``CpMemory.prepare``) as they arrive, each to the replica with the longest
  cached prefix (ties: less work queued);
* ``windows`` (``--hold-fit``, what ships): admitted while the estimated prompt tokens in flight fit the replicas'
  caches, else held; a request that ends with room again releases *every* held question as one window, planned by
  ``CpMemory.release_plan`` (split over the replicas when it outgrows their caches), each lane to one replica;
* ``windows 1 a replica`` (``--max-in-flight 1``): the same, a replica runs one request at a time;
* ``pick`` (``--max-in-flight 1 --hold-pick``): a replica runs one request at a time; when one is free it takes
  *one* held question: one of the plan lane that replica runs (a split plan's run for it), then the one whose order
  finds the longest cached prefix in that replica's cache, then the plans' order. The questions held since the last
  plan are planned together (``release_plan``, lanes) just before a pick, so arrivals join the choice until a
  replica can take them;
* ``pick prefix first``: the longest cached prefix before the lane (the first version, not kept: a burst of 64
  cached 47.8% against 51.6%; Poisson arrivals the same);
* ``pick blind``: the same without the cache view (lane, then the plans' order);
* ``pick replan``: at each pick, every held question planned again together (not only those held since the last
  plan), a replica taking by its run, then its cached prefix, then the new plan's order (not kept: at twice the
  original's capacity 37.6% cached against 39.4%, at three times 39.8% against 43.7%, a burst of 64 31.4% against
  51.6%: each new plan moves the runs under the replicas).

It prints the mean time to the end of prefill (the model's TTFT), requests per time unit over the span and the
cached share, with the ratios against the first policy in the same run. No engine needed; about 5 s a seed.

usage: scripts/hold_model.py [--requests 96] [--load 2.0 ...] [--closed C] [--seeds 3] [--cache 17408]
                             [--policies original,windows,pick]
"""

from __future__ import annotations

import argparse
import heapq
import zlib
from collections import deque
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from cpmemory.bench.loaders import load_workload
from cpmemory.bench.serve_run import ServeSettings, select_jobs
from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.facade import CpMemory
from cpmemory.session.config import DEFAULT_SYSTEM_PROMPT

REPLICAS = 2


class Fleet:
    """Two replicas, each one prompt at a time in arrival order, an LRU prefix cache each."""

    def __init__(self, capacity: int) -> None:
        self.caches = [PrefixCacheSimulator(capacity, mode="vllm", page_size=128) for _ in range(REPLICAS)]
        self.queues: list[deque] = [deque() for _ in range(REPLICAS)]
        self.busy_until = [0.0] * REPLICAS
        self.running: list[tuple | None] = [None] * REPLICAS
        self.queued_tokens = [0] * REPLICAS

    def send(self, replica: int, item: tuple, now: float, events: list) -> None:
        self.queues[replica].append(item)
        self.queued_tokens[replica] += len(item[1])
        self._start(replica, now, events)

    def _start(self, replica: int, now: float, events: list) -> None:
        if self.running[replica] is not None or not self.queues[replica]:
            return
        item = self.queues[replica].popleft()
        found = self.caches[replica].run(item[1])
        end = max(now, self.busy_until[replica]) + len(item[1]) - found
        self.busy_until[replica] = end
        self.running[replica] = item
        heapq.heappush(events, (end, 1, replica, item[0], found))

    def finish(self, replica: int, now: float, events: list) -> tuple:
        item = self.running[replica]
        self.running[replica] = None
        self.queued_tokens[replica] -= len(item[1])
        self._start(replica, now, events)
        return item


POLICIES = ("original", "no hold", "windows", "windows 1 a replica", "pick", "pick prefix first", "pick blind",
            "pick replan")


def simulate(policy, jobs, keys, size, system, question, arrivals, capacity, memory, closed=0):
    """Serve ``jobs`` under ``policy``; return (mean TTFT, requests per time unit, cached tokens)."""
    arrivals = list(arrivals)
    next_question = closed
    if closed:  # a closed loop: the first ``closed`` questions at once, each answer sends the next one
        arrivals = [0.0] * len(jobs)
    starts, offset = {}, system
    for key in size:
        starts[key], offset = offset, offset + size[key]

    def prompt_of(index, order):
        parts = [np.arange(system)]
        parts += [np.arange(starts[key], starts[key] + size[key]) for key in order]
        parts.append(np.arange(offset + 100_000 * index, offset + 100_000 * index + question[index]))
        return np.concatenate(parts)

    budget = capacity * REPLICAS
    estimate = [system + sum(size[key] for key in k) + question[i] for i, k in enumerate(keys)]
    fleet = Fleet(capacity)
    events: list = [(arrivals[index], 0, -1, index, 0) for index in range(closed or len(jobs))]
    heapq.heapify(events)
    held: list[int] = []
    in_flight = 0  # estimated prompt tokens sent and not ended
    done: dict[int, tuple[float, int]] = {}
    lane_replica: dict[tuple[int, int], int] = {}  # (plan, lane) -> the replica it runs on
    lane_of: dict[int, tuple[int, int]] = {}  # question -> (plan, lane)
    ordered: dict[int, list] = {}  # question -> its block order (pick: decided when planned)
    rank: dict[int, int] = {}  # question -> its place in the plans' order
    plans = 0

    def prepare(index):
        """The facade's order for the question (a planned one when ``release_plan`` planned it)."""
        job = jobs[index]
        turn = memory.prepare(job.conversation, job.request.query, list(job.prepared.blocks))
        memory.commit(turn, "a short answer")
        key_of = {block.id: key for block, key in zip(job.prepared.blocks, job.prepared.keys)}
        return [key_of[block_id] for block_id in turn.prompt_order]

    def send(index, order, now, replicas=range(REPLICAS)):
        nonlocal in_flight
        prompt = prompt_of(index, order)
        replica = max(replicas, key=lambda r: (fleet.caches[r].peek(prompt), -fleet.queued_tokens[r]))
        in_flight += estimate[index]
        fleet.send(replica, (index, prompt), now, events)
        return replica

    def plan(questions, lanes):
        """Plan ``questions`` as one window (``CpMemory.release_plan``); return them in its order."""
        nonlocal plans
        plans += 1
        if len(questions) == 1:
            return questions
        planned = memory.release_plan([list(jobs[i].prepared.blocks) for i in questions], cache_tokens=budget,
                                      lanes=lanes)
        for position, lane in enumerate(planned.lanes):
            if lane is not None:
                lane_of[questions[position]] = (plans, lane)
        return [questions[position] for position in planned.order]

    def release_window(now):
        """Every held question as one window, each lane to one replica (what ships)."""
        nonlocal held
        window, held = held, []
        for index in plan(window, REPLICAS):
            lane = lane_of.get(index)
            taken = {r for key, r in lane_replica.items() if key[0] == plans and key != lane}
            replica = lane_replica.get(lane) if lane is not None else None
            free = [r for r in range(REPLICAS) if r not in taken] or list(range(REPLICAS))
            replica = send(index, prepare(index), now, [replica] if replica is not None else free)
            if lane is not None:
                lane_replica[lane] = replica

    def idle():
        return [r for r in range(REPLICAS) if fleet.running[r] is None and not fleet.queues[r]]

    def take(now, order_of, lanes, ranks, claims, send_order):
        """While a replica is idle, send it one held question: of the lane it runs (then of no lane or of a lane
        nobody runs), then the one whose order finds the longest cached prefix there, then the plans' order
        (``pick prefix first``: the prefix before the lane; ``pick blind``: no prefix)."""
        while held and idle():
            best = None
            for position, index in enumerate(held):
                prompt = prompt_of(index, order_of(index))
                lane = lanes.get(index)
                for replica in idle():
                    claim = claims.get(lane) if lane is not None else None
                    found = fleet.caches[replica].peek(prompt) if policy != "pick blind" else 0
                    fit = 2 if claim == replica else int(claim is None)
                    score = (found, fit, -ranks[index]) if policy == "pick prefix first" else (fit, found, -ranks[index])
                    if best is None or score > best[0]:
                        best = (score, position, replica)
            _, position, replica = best
            index = held.pop(position)
            if index in lanes:
                claims.setdefault(lanes[index], replica)
            send(index, send_order(index), now, [replica])

    def release_pick(now):
        """The questions held since the last plan are planned together first (only once a replica is idle), then
        :func:`take`."""
        fresh = [index for index in held if index not in ordered]
        if not idle():
            return  # planned when a replica can take one: the questions held until then are planned together
        for index in plan(fresh, REPLICAS) if fresh else []:
            ordered[index] = prepare(index)
            rank[index] = len(rank)
        take(now, ordered.__getitem__, lane_of, rank, lane_replica, ordered.__getitem__)

    def release_replan(now):
        """Every held question planned again together at each pick (its orders, lanes and ranks), then
        :func:`take` with the new plan's lanes; each question is prepared when sent."""
        if not idle() or not held:
            return
        planned = memory.release_plan([list(jobs[i].prepared.blocks) for i in held], cache_tokens=budget,
                                      lanes=REPLICAS)
        orders = {index: list(planned.orders[position]) for position, index in enumerate(held)}
        lanes = {index: lane for index, lane in zip(held, planned.lanes) if lane is not None}
        ranks = {held[position]: r for r, position in enumerate(planned.order)}
        take(now, orders.__getitem__, lanes, ranks, {}, prepare)

    while events:
        now, kind, replica, index, found = heapq.heappop(events)
        if kind == 0:  # a question arrives
            if policy == "original":
                affinity = zlib.crc32(jobs[index].conversation.encode()) % REPLICAS
                send(index, keys[index], now, [affinity])
            elif policy == "no hold":
                send(index, prepare(index), now)
            elif policy == "pick replan":
                held.append(index)
                release_replan(now)
            elif policy.startswith("pick"):
                held.append(index)
                release_pick(now)
            elif policy == "windows 1 a replica":
                if not held and idle():
                    send(index, prepare(index), now)
                else:
                    held.append(index)
            elif not held and (in_flight == 0 or in_flight + estimate[index] <= budget):
                send(index, prepare(index), now)
            else:
                held.append(index)
            continue
        fleet.finish(replica, now, events)  # a prefill ended
        in_flight -= estimate[index]
        done[index] = (now, found)
        if next_question and next_question < len(jobs):
            arrivals[next_question] = now
            heapq.heappush(events, (now, 0, -1, next_question, 0))
            next_question += 1
        if policy == "pick replan":
            release_replan(now)
        elif policy.startswith("pick"):
            release_pick(now)
        elif held and (in_flight == 0 or (idle() if policy == "windows 1 a replica" else in_flight <= budget)):
            release_window(now)
    ttft = np.mean([done[i][0] - arrivals[i] for i in range(len(jobs))])
    span = max(t for t, _ in done.values()) - min(arrivals)
    return ttft, len(jobs) / span, sum(f for _, f in done.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="locomo_sessions")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--load", type=float, nargs="+", default=[2.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--closed", type=int, default=0, help="a closed loop of this many clients instead")
    parser.add_argument("--cache", type=int, default=17_408, help="tokens a replica (the bench replicas: 17,408)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, the first is the baseline")
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "data"))
    parser.add_argument("--model-dir", default="/root/.cache/cpmemory/wide-model")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    trace = load_workload(args.workload, args.data_dir)
    settings = ServeSettings(engines=("x",), requests=args.requests, concurrency=1, max_turns=1)
    jobs = [job for session in select_jobs(trace, settings, "model") for job in session]
    keys = [list(job.prepared.keys) for job in jobs]
    size = {key: count(block.text) for job in jobs for key, block in zip(job.prepared.keys, job.prepared.blocks)}
    system = count(DEFAULT_SYSTEM_PROMPT)
    question = [count(job.request.query) for job in jobs]
    prompt_tokens = sum(system + sum(size[k] for k in ks) + q for ks, q in zip(keys, question))
    service = prompt_tokens / len(jobs) * 0.93  # the original caches about 7% (measured)
    policies = [p.strip() for p in args.policies.split(",")]

    table = Table(title=f"{args.workload}, {len(jobs)} questions, {prompt_tokens:,} prompt tokens, two caches of "
                  f"{args.cache:,}; mean over {args.seeds} arrival seeds")
    for column in ("load", "policy", "TTFT (ratio)", "requests/s (ratio)", "cached"):
        table.add_column(column, justify="left" if column in ("policy",) else "right")
    for load in [args.load[0]] if args.closed else args.load:
        sums: dict[str, np.ndarray] = {p: np.zeros(3) for p in policies}
        ratios: dict[str, np.ndarray] = {p: np.zeros(2) for p in policies}
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            rate = load * REPLICAS / service
            arrivals = list(np.cumsum(rng.exponential(1 / rate, len(jobs))))
            base = None
            for policy in policies:
                figures = np.array(simulate(policy, jobs, keys, size, system, question, arrivals, args.cache,
                                            CpMemory(), args.closed))
                if base is None:
                    base = figures
                sums[policy] += figures / args.seeds
                ratios[policy] += np.array([base[0] / figures[0], figures[1] / base[1]]) / args.seeds
        for policy in policies:
            ttft, rps, cached = sums[policy]
            table.add_row(f"closed loop of {args.closed}" if args.closed else f"{load:g}", policy, f"{ttft:,.0f} ({ratios[policy][0]:.2f}x)",
                          f"{rps * 1e4:.3f} ({ratios[policy][1]:.2f}x)", f"{cached / prompt_tokens:.1%}")
    Console().print(table)


if __name__ == "__main__":
    main()
