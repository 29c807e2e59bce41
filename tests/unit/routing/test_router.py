"""Router: rendezvous affinity, minimal disruption, load fallback, failover, probes."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.errors import InvalidInputError, NoHealthyReplicaError
from cpmemory.routing.router import (
    Router,
    RouterConfig,
    branch_affinity_key,
    conversation_affinity_key,
    job_affinity_key,
)

URLS = [f"http://127.0.0.1:{8000 + i}" for i in range(4)]


def test_same_key_same_replica_and_keys_spread() -> None:
    router = Router(URLS)
    keys = [conversation_affinity_key("t", f"c{i}") for i in range(2000)]
    first = [router.choose(key).url for key in keys]
    assert first == [router.choose(key).url for key in keys]
    counts = Counter(first)
    assert set(counts) == set(URLS)
    assert min(counts.values()) > 2000 / len(URLS) * 0.7  # rendezvous spreads keys about evenly


def test_down_replica_moves_only_its_keys_and_they_come_back() -> None:
    router = Router(URLS)
    keys = [conversation_affinity_key("t", f"c{i}") for i in range(500)]
    before = {key: router.choose(key).url for key in keys}
    router.mark_down(URLS[1])
    during = {key: router.choose(key) for key in keys}
    for key in keys:
        if before[key] != URLS[1]:
            assert during[key].url == before[key] and during[key].reason == "affinity"
        else:
            assert during[key].url != URLS[1] and during[key].reason == "failover"
            assert during[key].url == router.ranking(key)[1]
    router.mark_up(URLS[1])
    assert {key: router.choose(key).url for key in keys} == before


def test_load_fallback_needs_both_thresholds() -> None:
    router = Router(URLS[:2], RouterConfig(balance_abs_threshold=4, balance_rel_threshold=2.0))
    key = conversation_affinity_key("t", "busy")
    preferred = router.choose(key).url
    other = next(url for url in URLS[:2] if url != preferred)
    for _ in range(5):
        router.begin(preferred)
    assert router.choose(key).reason == "load" and router.choose(key).url == other
    for _ in range(3):
        router.begin(other)  # gap 2 <= 4: affinity wins again
    assert router.choose(key).url == preferred
    for _ in range(6):
        router.begin(preferred)  # 11 vs 3: gap 8 > 4 and 11 > 2 * 3
    assert router.choose(key).url == other
    for _ in range(11):
        router.end(preferred)
    assert router.choose(key).reason == "affinity"


def test_no_healthy_replica_raises_typed_error() -> None:
    router = Router(URLS[:2])
    router.mark_down(URLS[0])
    with pytest.raises(NoHealthyReplicaError):
        router.choose("k", exclude=[URLS[1]])
    router.mark_down(URLS[1])
    with pytest.raises(NoHealthyReplicaError):
        router.choose("k")


def test_probe_brings_back_only_answering_replicas() -> None:
    router = Router(URLS[:3])
    router.mark_down(URLS[0])
    router.mark_down(URLS[1])

    async def check(url: str) -> bool:
        if url == URLS[1]:
            raise ConnectionError("still down")
        return True

    recovered = asyncio.run(router.probe(check))
    assert recovered == [URLS[0]]
    assert [s.healthy for s in router.status()] == [True, False, True]


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(InvalidInputError):
        Router([])
    with pytest.raises(InvalidInputError):
        Router(["http://a", "http://a/"])
    with pytest.raises(InvalidInputError):
        Router(["http://a"]).begin("http://b")


def test_affinity_keys_are_injective() -> None:
    assert conversation_affinity_key("a|1:b", "c") != conversation_affinity_key("a", "1:b|c")
    assert job_affinity_key("t", "x") != conversation_affinity_key("t", "x")
    assert branch_affinity_key("t", (3, 1)) == branch_affinity_key("t", (3, 7))
    assert branch_affinity_key("t", (3,)) != branch_affinity_key("t", (4,))


@settings(max_examples=150, deadline=None)
@given(
    key=st.text(max_size=50),
    down=st.sets(st.integers(0, 3)),
    excluded=st.sets(st.integers(0, 3)),
    loads=st.lists(st.integers(0, 50), min_size=4, max_size=4),
)
def test_choice_is_always_a_usable_replica(key: str, down: set[int], excluded: set[int], loads: list[int]) -> None:
    router = Router(URLS, RouterConfig(balance_abs_threshold=5, balance_rel_threshold=1.5))
    for index, load in enumerate(loads):
        for _ in range(load):
            router.begin(URLS[index])
    for index in down:
        router.mark_down(URLS[index])
    usable = {URLS[i] for i in range(4) if i not in down and i not in excluded}
    assert sorted(router.ranking(key)) == sorted(URLS)
    if not usable:
        with pytest.raises(NoHealthyReplicaError):
            router.choose(key, exclude=[URLS[i] for i in excluded])
        return
    decision = router.choose(key, exclude=[URLS[i] for i in excluded])
    assert decision.url in usable and URLS[decision.index] == decision.url
    if decision.reason == "load":
        assert loads[decision.index] == min(loads[URLS.index(url)] for url in usable)


def test_session_policy_places_first_calls_by_load_and_keeps_later_ones_sticky() -> None:
    router = Router(URLS[:2], RouterConfig(policy="session"))
    keys = [conversation_affinity_key("t", f"s{i}") for i in range(8)]
    placed = {}
    for key in keys:  # eight conversations start together: each first call goes where fewest are in flight
        decision = router.choose(key, sticky=True)
        assert decision.reason == "cold"
        router.begin(decision.url)
        router.record(key, decision, sticky=True)
        placed[key] = decision.url
    assert Counter(placed.values()) == {URLS[0]: 4, URLS[1]: 4}  # a hash deals 8 keys 4:4 only by luck
    for url in URLS[:2]:
        for _ in range(4):
            router.end(url)
    for _ in range(3):
        router.begin(URLS[0])  # the later turns stay on their replica although it is busier
    for key in keys:
        again = router.choose(key, sticky=True)
        assert (again.url, again.reason) == (placed[key], "affinity")
    new = router.choose(conversation_affinity_key("t", "new"), sticky=True)
    assert (new.url, new.reason) == (URLS[1], "cold")


def test_session_policy_fails_over_and_sheds_an_overloaded_replica() -> None:
    router = Router(URLS[:2], RouterConfig(policy="session", balance_abs_threshold=2, balance_rel_threshold=1.5))
    key = conversation_affinity_key("t", "a")
    first = router.choose(key, sticky=True)
    router.record(key, first, sticky=True)
    other = next(url for url in URLS[:2] if url != first.url)
    router.mark_down(first.url)
    moved = router.choose(key, sticky=True)
    assert (moved.url, moved.reason) == (other, "failover")
    router.mark_up(first.url)
    for _ in range(4):
        router.begin(first.url)  # 4 in flight against 0: past both thresholds
    shed = router.choose(key, sticky=True)
    assert (shed.url, shed.reason) == (other, "load")
    unsticky = router.choose(key)  # not sticky: a first call, by load
    assert (unsticky.url, unsticky.reason) == (other, "cold")
