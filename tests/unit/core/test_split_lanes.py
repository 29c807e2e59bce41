"""Splitting a planned window over replicas (cpmemory.core.scheduling.split_lanes): even work, prefixes kept
together, shortest mean work first; checked against brute force on small windows."""
from __future__ import annotations

import itertools
import random

import pytest

from cpmemory.core.scheduling import interleave, request_work, split_lanes


def lane_work(orders, sizes, lane, tail=0.0):
    """What a lane computes, each request after the longest prefix it shares with any earlier one of its lane."""
    total = 0.0
    for index, position in enumerate(lane):
        shared = max((_common(orders[earlier], orders[position]) for earlier in lane[:index]), default=0)
        total += tail + sum(sizes[key] for key in orders[position][shared:])
    return total


def _common(first, second):
    return next((count for count, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))


def completion_sum(orders, sizes, lanes, tail=0.0):
    """Sum of completion times with each lane run one request after the other, time = work computed."""
    total = 0.0
    for lane in lanes:
        clock = 0.0
        for index in range(len(lane)):
            clock = lane_work(orders, sizes, lane[: index + 1], tail)
            total += clock
    return total


def depth_first_window(rng: random.Random, count: int):
    """A window in depth-first order: requests drawn from a few shared prefixes, sorted (as a trie walk)."""
    roots = [[f"r{root}-{depth}" for depth in range(rng.randint(1, 3))] for root in range(rng.randint(1, 4))]
    orders = sorted(rng.choice(roots)[: rng.randint(1, 3)] + [f"own{position}"] for position in range(count))
    sizes = {key: float(rng.randint(1, 9) * 10) for order in orders for key in order}
    return orders, sizes


def test_the_lanes_cover_the_window_once_and_a_shared_prefix_stays_on_one_lane():
    orders = [["a", "a1"], ["a", "a2"], ["a", "a3"], ["b", "b1"], ["b", "b2"], ["b", "b3"]]
    sizes = {key: 100.0 if len(key) == 1 else 10.0 for order in orders for key in order}
    lanes = split_lanes(orders, sizes, 2)
    assert sorted(position for lane in lanes for position in lane) == list(range(6))
    assert sorted(map(sorted, lanes)) == [[0, 1, 2], [3, 4, 5]]


def test_a_unit_larger_than_its_share_is_cut_where_the_cut_costs_least():
    # one prefix shared by 8 requests, 4 small cold ones: two lanes cannot both keep the big unit whole and be even
    orders = [["p", "q", f"x{i}"] for i in range(4)] + [["p", "r", f"y{i}"] for i in range(4)]
    orders += [[f"cold{i}"] for i in range(2)]
    sizes = {"p": 50.0, "q": 200.0, "r": 200.0, **{key: 20.0 for order in orders for key in order[-1:]}}
    lanes = split_lanes(orders, sizes, 2)
    works = [lane_work(orders, sizes, lane) for lane in lanes]
    assert max(works) < lane_work(orders, sizes, list(range(10)))  # split, not one lane
    lane_of = {position: index for index, lane in enumerate(lanes) for position in lane}
    assert len({lane_of[i] for i in range(4)}) == 1 and len({lane_of[i] for i in range(4, 8)}) == 1  # cut at p


@pytest.mark.parametrize("seed", range(30))
def test_the_split_is_the_most_even_contiguous_one(seed):
    rng = random.Random(seed)
    orders, sizes = depth_first_window(rng, rng.randint(2, 9))
    tail = float(rng.randint(0, 20))
    lanes = split_lanes(orders, sizes, 2, tail)
    whole, after = request_work(orders, sizes, tail)

    def run(start, end):  # the contiguous run's work as split_lanes models it
        return whole[start] + sum(after[start + 1:end]) if end > start else 0.0

    best = min(max(run(0, cut), run(cut, len(orders))) for cut in range(1, len(orders)))
    got = max(run(min(lane), max(lane) + 1) for lane in lanes if lane)
    assert got == pytest.approx(best)
    for lane in lanes:  # each lane is one contiguous run of the window
        assert sorted(lane) == list(range(min(lane), max(lane) + 1))


@pytest.mark.parametrize("seed", range(30))
def test_each_lane_runs_in_the_order_that_minimises_its_completion_times_among_unit_orders(seed):
    rng = random.Random(100 + seed)
    orders, sizes = depth_first_window(rng, rng.randint(2, 8))
    (lane,) = split_lanes(orders, sizes, 1)
    units: list[list[int]] = []
    for position in range(len(orders)):
        if units and _common(orders[position - 1], orders[position]):
            units[-1].append(position)
        else:
            units.append([position])
    best = min(completion_sum(orders, sizes, [[p for unit in perm for p in unit]])
               for perm in itertools.permutations(units))
    assert completion_sum(orders, sizes, [lane]) == pytest.approx(best)
    for unit in units:  # a unit's requests keep their order, its head first
        assert [p for p in lane if p in unit] == unit


def test_more_lanes_than_requests_leaves_lanes_empty_and_bad_lanes_are_rejected():
    assert split_lanes([["a"], ["b"]], {"a": 1.0, "b": 1.0}, 4) == [[0], [1], [], []]
    assert split_lanes([], {}, 2) == [[], []]
    with pytest.raises(ValueError):
        split_lanes([["a"]], {"a": 1.0}, 0)


def test_interleave_deals_one_from_each_lane_in_turn():
    assert interleave([[1, 2, 3], [4], [], [5, 6]]) == [1, 4, 5, 2, 6, 3]
    assert interleave([]) == []
