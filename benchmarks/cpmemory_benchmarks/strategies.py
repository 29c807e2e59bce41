"""The strategies the replay compares: for each, an execution order and a block order per request.

* ``original``: retrieval order, first come first served.
* ``original+lpm``: retrieval order; SGLang's longest-prefix-match scheduling (see :class:`LongestPrefixScheduler`).
* ``popularity``: each request's blocks sorted by how often the trace retrieves them (ties: first retrieved first),
  FCFS -- the naive thing a user might try.
* ``reorder`` / ``reorder+schedule``: the paper's offline pipeline (``cpmemory.core.ordering.reorder_batch``, then
  ``cpmemory.core.scheduling.schedule`` for the second).
* ``contextpilot``: the authors' package (:mod:`cpmemory_benchmarks.baseline_contextpilot`).
* ``cpmemory``: ``cpmemory.core.planner.plan_batch`` for order and schedule (prompts are then built by the facade,
  which adds de-duplication and annotations; see :mod:`cpmemory.bench.prompts`).

Every planner gets the same input: one context per request, the block keys in retrieval order (a key is the
block's content hash, so equal texts are equal blocks). Multi-turn traces: a schedule may interleave sessions but
never reorders a session's turns (:func:`keep_turn_order` repairs any order that would).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Hashable, Sequence

from cpmemory.bench.offline import (
    PlanInput,
    Planner,
    StrategyPlan,
    checked_contexts,
    keep_turn_order,
    plan_cpmemory,
    plan_original,
)

STRATEGIES = ("original", "original+lpm", "popularity", "reorder", "reorder+schedule", "contextpilot", "cpmemory")
LPM_WINDOW = 128


def plan_lpm(batch: PlanInput) -> StrategyPlan:
    """Retrieval order; the order is decided online by :class:`LongestPrefixScheduler`."""
    return StrategyPlan(None, [list(c) for c in batch.contexts], 0.0)


def plan_popularity(batch: PlanInput) -> StrategyPlan:
    """Sort each request's blocks by retrieval frequency over the trace (most frequent first), FCFS."""
    started = time.perf_counter()
    frequency: Counter[Hashable] = Counter(key for context in batch.contexts for key in set(context))
    first_seen: dict[Hashable, int] = {}
    for context in batch.contexts:
        for key in context:
            first_seen.setdefault(key, len(first_seen))
    contexts = [sorted(context, key=lambda key: (-frequency[key], first_seen[key])) for context in batch.contexts]
    return StrategyPlan(list(range(len(contexts))), contexts, time.perf_counter() - started)


def plan_reorder(batch: PlanInput, *, schedule_too: bool = False) -> StrategyPlan:
    """The paper's reorder (CORE's ``reorder_batch``); with ``schedule_too`` also its scheduling (Algorithm 5)."""
    from cpmemory.core.ordering import reorder_batch
    from cpmemory.core.scheduling import schedule

    started = time.perf_counter()
    result = reorder_batch([list(c) for c in batch.contexts])
    order = list(schedule(result.search_paths)) if schedule_too else list(range(len(batch.contexts)))
    seconds = time.perf_counter() - started
    contexts = checked_contexts(batch.contexts, result.contexts, "reorder")
    return StrategyPlan(_session_safe(order, batch), contexts, seconds)


def plan_contextpilot(batch: PlanInput) -> StrategyPlan:
    """The authors' package on a fresh instance (raises MissingDependencyError when it is not installed)."""
    from cpmemory_benchmarks.baseline_contextpilot import plan_with_contextpilot

    started = time.perf_counter()
    result = plan_with_contextpilot(batch.contexts)
    seconds = time.perf_counter() - started
    contexts = checked_contexts(batch.contexts, result.contexts, "contextpilot")
    return StrategyPlan(_session_safe(result.order, batch), contexts, seconds)


def _session_safe(order: list[int], batch: PlanInput) -> list[int]:
    return keep_turn_order(order, batch.sessions)


PLANNERS: dict[str, Planner] = {
    "original": plan_original,
    "original+lpm": plan_lpm,
    "popularity": plan_popularity,
    "reorder": plan_reorder,
    "reorder+schedule": lambda batch: plan_reorder(batch, schedule_too=True),
    "contextpilot": plan_contextpilot,
    "cpmemory": plan_cpmemory,
}


class LongestPrefixScheduler:
    """SGLang's longest-prefix-match policy, approximated at segment granularity.

    The waiting queue holds the next :data:`LPM_WINDOW` requests in arrival order (for a multi-turn trace, only each
    session's next turn waits). At each step the waiting request whose prompt has the longest cached prefix runs
    (ties: earliest arrival). The cache is mirrored at segment boundaries (messages and blocks): an LRU map from the
    chained hash of a prompt's first k segments to the tokens that k-th segment adds, trimmed to the simulator's
    capacity. A request's cached prefix is the longest run of its leading segment prefixes still in the map. This
    is a scheduling heuristic only; hits are always measured by the real simulator.
    """

    def __init__(self, capacity_tokens: int, window: int = LPM_WINDOW) -> None:
        """Create an empty mirror of a cache of ``capacity_tokens``."""
        self.capacity_tokens = capacity_tokens
        self.window = window
        self._entries: OrderedDict[int, int] = OrderedDict()
        self._used = 0

    def _prefix_keys(self, segments: Sequence[tuple[Hashable, int]]) -> list[tuple[int, int]]:
        keys, running = [], 0
        for key, tokens in segments:
            running = hash((running, key))
            keys.append((running, tokens))
        return keys

    def _matched(self, prefix_keys: Sequence[tuple[int, int]]) -> int:
        total = 0
        for key, tokens in prefix_keys:
            if key not in self._entries:
                break
            total += tokens
        return total

    def _execute(self, prefix_keys: Sequence[tuple[int, int]]) -> None:
        for key, tokens in prefix_keys:
            if key in self._entries:
                self._entries.move_to_end(key)
            else:
                self._entries[key] = tokens
                self._used += tokens
        while self._used > self.capacity_tokens and self._entries:
            _key, tokens = self._entries.popitem(last=False)
            self._used -= tokens

    def order(self, segments: Sequence[Sequence[tuple[Hashable, int]]], sessions: Sequence[str],
              multi_turn: bool) -> list[int]:
        """Return the execution order of requests whose prompts are ``segments`` (``(content key, tokens)`` lists).

        Mutates the mirror. O(n * window * segments per prompt).
        """
        prefix_keys = [self._prefix_keys(s) for s in segments]
        queues: dict[str, list[int]] = defaultdict(list)
        for index, session in enumerate(sessions):
            queues[session].append(index)
        arrivals = iter(range(len(sessions)))
        waiting: list[int] = []
        blocked: set[int] = set()
        out: list[int] = []
        while len(out) < len(sessions):
            self._fill(waiting, blocked, arrivals, queues, sessions, multi_turn)
            best = max(waiting, key=lambda index: (self._matched(prefix_keys[index]), -index))
            waiting.remove(best)
            self._execute(prefix_keys[best])
            out.append(best)
            if multi_turn:
                session_queue = queues[sessions[best]]
                session_queue.pop(0)
                if session_queue and session_queue[0] in blocked:
                    blocked.discard(session_queue[0])
                    waiting.append(session_queue[0])
        return out

    def _fill(self, waiting: list[int], blocked: set[int], arrivals, queues, sessions, multi_turn: bool) -> None:
        while len(waiting) < self.window:
            index = next(arrivals, None)
            if index is None:
                return
            if multi_turn and queues[sessions[index]][0] != index:
                blocked.add(index)
            else:
                waiting.append(index)
