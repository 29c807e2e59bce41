"""The multi-replica simulation: N caches behind the product's router."""
from __future__ import annotations

import random

import pytest

from cpmemory.bench.simulator import PrefixCacheSimulator
from cpmemory.errors import InvalidInputError
from cpmemory_benchmarks.replicas import FleetSettings, ReplicaFleet, replay_prompts


def grouped_prompts(groups: int = 16, count: int = 800, seed: int = 3) -> list[list[int]]:
    """Prompts of ``groups`` families: a 400-token family prefix, then 40 tokens of their own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(400)] for _ in range(groups)]
    return [prefixes[rng.randrange(groups)] + [rng.randrange(1, 50_000) for _ in range(40)] for _ in range(count)]


def test_one_replica_is_the_single_cache() -> None:
    prompts = grouped_prompts(count=200)
    single = PrefixCacheSimulator(3000)
    expected = sum(single.run(p) for p in prompts)
    report = replay_prompts(prompts, 3000, FleetSettings(1))
    assert report.replicas[0].cached_tokens == expected and report.load_max_over_mean == 1.0


def test_prefix_routing_keeps_the_single_cache_hit_rate_with_balanced_load() -> None:
    prompts = grouped_prompts()
    capacity = 20 * 440  # one cache holds every family, each replica a quarter of that
    single = PrefixCacheSimulator(capacity)
    for p in prompts:
        single.run(p)
    prefix = replay_prompts(prompts, capacity, FleetSettings(4, "prefix"))
    affinity = replay_prompts(prompts, capacity, FleetSettings(4, "affinity"))
    assert prefix.hit_rate >= 0.9 * single.stats.hit_rate  # (the 95% target is measured on real traces)
    assert prefix.hit_rate > affinity.hit_rate + 0.1  # random placement spreads every family over every replica
    assert prefix.load_max_over_mean <= 1.3
    assert sum(r.requests for r in prefix.replicas) == len(prompts)
    assert prefix.reasons.get("prefix", 0) > len(prompts) * 0.8


def test_sticky_conversations_stay_on_one_replica() -> None:
    fleet = ReplicaFleet(40_000, FleetSettings(4, "prefix"))
    rng = random.Random(1)
    history: dict[str, list[int]] = {}
    for turn in range(6):
        for conversation in ("a", "b", "c"):
            history.setdefault(conversation, [])
            history[conversation] += [rng.randrange(1, 9999) for _ in range(100)]
            fleet.run(history[conversation], key=conversation, sticky=turn > 0)
    report = fleet.report()
    assert report.reasons.get("affinity", 0) == 15  # every later turn went back to its conversation's replica


@pytest.mark.skipif(not hasattr(PrefixCacheSimulator, "peek"), reason="the simulator has no peek yet")
def test_peek_changes_nothing() -> None:
    fleet = ReplicaFleet(10_000, FleetSettings(2))
    prompt = list(range(300))
    fleet.run(prompt)
    before = fleet.report()
    assert fleet.peek(prompt) >= 256
    assert fleet.report() == before


@pytest.mark.parametrize("kwargs", [{"replicas": 0}, {"router": "random"}, {"concurrency": 0}])
def test_bad_settings_are_typed_errors(kwargs) -> None:
    with pytest.raises(InvalidInputError):
        FleetSettings(**kwargs)


def test_online_replay_on_replicas_reports_load_and_one_replica_is_the_single_cache(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from cpmemory.bench.loaders import load_synthetic
    from cpmemory.bench.trace import Trace, write_trace
    from cpmemory.cli import app
    from cpmemory_benchmarks.replay import ReplaySettings, run_replay

    trace = load_synthetic(requests=120, blocks_per_request=6, corpus_size=50, seed=5)
    settings = ReplaySettings(capacity="20%", strategies=("original",))
    single = run_replay(trace, settings, online_window=1).to_json()["online"]["strategies"]
    one = run_replay(trace, settings, online_window=1, fleet=FleetSettings(1)).to_json()["online"]
    four = run_replay(trace, settings, online_window=1, fleet=FleetSettings(4)).to_json()["online"]
    assert one["replicas"] == 1 and four["replicas"] == 4 and four["router"] == "prefix"
    for name, figures in single.items():  # one replica behind the router is exactly the one cache
        assert one["strategies"][name]["hit_rate"] == figures["hit_rate"], name
        assert one["strategies"][name]["replica_load_max_over_mean"] == 1.0
    ours = four["strategies"]["cpmemory"]
    assert ours["no_loss_violations"] == 0 and sum(ours["replicas"]["requests"]) == 120
    assert 1.0 <= ours["replica_load_max_over_mean"] <= 1.5
    path = tmp_path / "t.jsonl"
    write_trace(Trace("t", trace.requests[:30]), path)
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(path), "--online", "--replicas", "2",
                                      "--router", "affinity", "--strategies", "original", "--json"])
    assert result.exit_code == 0, result.output
    online = json.loads(result.stdout.strip().splitlines()[-1])["online"]
    assert online["router"] == "affinity" and "replica_load_max_over_mean" in online["strategies"]["trie"]
    bad = CliRunner().invoke(app, ["bench", "replay", "--trace", str(path), "--replicas", "2", "--json"])
    assert bad.exit_code == 2 and "--online" in bad.output
