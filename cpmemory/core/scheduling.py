"""Scheduling: run requests that share a prefix back to back (paper Algorithm 5), and split a window of them
over replicas (lanes).

:func:`schedule`: requests are grouped by the first element of their search path (the top-level subtree they fall
in); inside a group the longest paths (deepest, most specific prefixes) go first; groups go largest first. Ties keep
the input order, so the result is deterministic. Requests with an empty path (nothing shared) form one group.

:func:`split_lanes`: a planned window (requests in run order, each with its block order) is cut into one contiguous
run per replica so that the replicas' prefill work is even, then each run is put in shortest-mean-work order. A
request's *work* is what its replica must compute: its tail (question, template) and its blocks after the longest
prefix it shares with the request before it in its run (in a depth-first schedule the one before shares the most).
A *unit* is a maximal run of requests each sharing a prefix with the one before; units share nothing with each
other, so they can be reordered without losing a cached prefix. Each run's units go in ascending order of work per
request (Smith's rule for the sum of completion times on one machine: a unit of many cheap followers before a lone
cold prompt), a unit's requests keep their order (its head computes the prefix the others reuse).

Why contiguous runs: in a depth-first schedule the requests sharing a prefix are adjacent, so a cut costs only the
prefix shared across it, which the split charges to the run it starts. Dealing out whole units instead (the prefix
router following each unit's first call) leaves the replicas uneven whenever one unit is large (docs/decisions.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cpmemory.core.planner_tree import common_prefix

__all__ = ["ReleasePlan", "interleave", "request_work", "schedule", "split_lanes"]


@dataclass(frozen=True, slots=True)
class ReleasePlan:
    """How to run a window of waiting requests.

    Attributes:
        order: the positions of the requests (in the window as it came) in the order to send them.
        lanes: per position, the lane (replica of the window's split, numbered from 0) it runs on, or None where the
            router decides (the window was not split, or the request has no blocks).
        orders: per position, the planned order of its blocks (their keys; empty when not given): what the hold's
            pick per free replica (``--hold pick``) compares with what each replica was sent.
    """

    order: tuple[int, ...]
    lanes: tuple[int | None, ...]
    orders: tuple[tuple[Hashable, ...], ...] = ()


def interleave(runs: Sequence[Sequence[int]]) -> list[int]:
    """The runs' items dealt one from each in turn (each run keeps its order): a window sent in this order starts
    every lane at once. Pure."""
    out: list[int] = []
    for depth in range(max((len(run) for run in runs), default=0)):
        out.extend(run[depth] for run in runs if depth < len(run))
    return out


def schedule(search_paths: Sequence[Sequence[int]]) -> list[int]:
    """Return the execution order: indices into ``search_paths``. Pure, O(N log N)."""
    groups: dict[int | None, list[int]] = {}
    for position, path in enumerate(search_paths):
        groups.setdefault(path[0] if len(path) else None, []).append(position)
    ordered_groups = sorted(groups.values(), key=len, reverse=True)  # stable: first-seen group wins a tie
    order: list[int] = []
    for members in ordered_groups:
        order.extend(sorted(members, key=lambda position: len(search_paths[position]), reverse=True))
    return order


def request_work(orders: Sequence[Sequence[Hashable]], sizes: Mapping[Hashable, float], tail: float = 0.0
                 ) -> tuple[list[float], list[float]]:
    """Per request of ``orders`` (in run order): (its whole work, its work after the one before it): ``tail`` plus
    the sizes of its blocks, all of them / those after the prefix it shares with the one before. Pure, O(total
    blocks)."""
    whole, after = [], []
    for position, order in enumerate(orders):
        own = [float(sizes.get(key, 0.0)) for key in order]
        shared = common_prefix(orders[position - 1], order) if position else 0
        whole.append(tail + sum(own))
        after.append(tail + sum(own[shared:]))
    return whole, after


def split_lanes(orders: Sequence[Sequence[Hashable]], sizes: Mapping[Hashable, float], lanes: int,
                tail: float = 0.0) -> list[list[int]]:
    """Split a window planned in run order over ``lanes`` replicas; return each lane's positions in run order.

    The cut points minimise the largest lane's work (then the total: a cut inside a unit is taken only when it
    evens the lanes); each lane's units then go in ascending work per request, a unit's requests in their order.
    Lanes may be empty (fewer requests than lanes). Deterministic. Pure; O(lanes * W^2) for W requests (numpy
    over the cut points) plus O(total blocks).

    Args:
        orders: each request's block order, in the planned run order.
        sizes: the size of each block (any unit; a block missing counts 0).
        lanes: the replicas to split over (1: the window is only reordered).
        tail: each request's size besides its blocks, in the unit of ``sizes``.

    Raises:
        ValueError: ``lanes`` < 1.
    """
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    count = len(orders)
    whole, after = request_work(orders, sizes, tail)
    prefix = [0.0]
    for value in after:
        prefix.append(prefix[-1] + value)

    used = min(lanes, count) or 1
    heads = np.asarray(whole) - np.asarray(prefix[1:])  # cost(start, end) = heads[start] + prefix[end]
    ends = np.asarray(prefix)
    worst = np.full(count + 1, np.inf)  # the largest lane of the best split of the first ``end`` requests
    total = np.full(count + 1, np.inf)
    worst[0] = total[0] = 0.0
    cut = np.zeros((used + 1, count + 1), dtype=np.int64)
    for lane in range(1, used + 1):
        new_worst, new_total = np.full(count + 1, np.inf), np.full(count + 1, np.inf)
        for end in range(lane, count + 1):
            starts = slice(lane - 1, end)
            run = heads[starts] + ends[end]
            largest = np.maximum(worst[starts], run)
            sums = total[starts] + run
            low = largest.min()
            if not np.isfinite(low):
                continue
            ties = np.flatnonzero(largest <= low * (1 + 1e-12))
            pick = int(ties[np.argmin(sums[ties])])
            new_worst[end], new_total[end] = largest[pick], sums[pick]
            cut[lane, end] = lane - 1 + pick
        worst, total = new_worst, new_total
    runs: list[list[int]] = []
    end = count
    for lane in range(used, 0, -1):
        start = int(cut[lane, end])
        runs.append(list(range(start, end)))
        end = start
    runs.reverse()
    runs += [[] for _ in range(lanes - len(runs))]
    return [_smith(run, whole, after) for run in runs]


def _smith(run: Sequence[int], whole: Sequence[float], after: Sequence[float]) -> list[int]:
    """A run's units in ascending work per request (stable), each unit's requests in order."""
    units: list[list[int]] = []
    for position in run:
        if units and after[position] < whole[position]:  # shares a prefix with the one before
            units[-1].append(position)
        else:
            units.append([position])
    mean = [(whole[unit[0]] + sum(after[position] for position in unit[1:])) / len(unit) for unit in units]
    ranked = sorted(range(len(units)), key=lambda index: mean[index])
    return [position for index in ranked for position in units[index]]
