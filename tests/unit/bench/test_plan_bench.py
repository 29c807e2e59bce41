"""bench plan: the figures, and the large-batch planner path is a valid plan."""
from __future__ import annotations

from collections import Counter

from cpmemory.bench.core_bench import WorkloadSpec, make_workload
from cpmemory.bench.plan_bench import run_plan_bench
from cpmemory.core import planner


def test_plan_bench_reports_its_figures():
    figures = run_plan_bench(300, k=8)
    assert {"seconds", "cpu_seconds", "peak_rss_mb", "requests", "saved_share"} <= figures.keys()
    assert figures["requests"] == 300 and 0 < figures["saved_share"] < 1


def test_the_large_batch_path_is_a_permutation_and_saves_at_least_a_popularity_sort(monkeypatch):
    contexts = make_workload(WorkloadSpec(contexts=400, k=8, seed=4))
    monkeypatch.setattr(planner, "LARGE_BATCH", 100)
    plan = planner.plan_batch(contexts)
    assert sorted(plan.order) == list(range(400))
    assert all(Counter(a) == Counter(b) for a, b in zip(plan.contexts, contexts))
    ranks = planner.first_seen_ranks(contexts)
    popularity = Counter(block for context in contexts for block in context)
    sorted_orders = [sorted(c, key=lambda b: (-popularity[b], ranks[b])) for c in contexts]
    assert planner.trie_savings(plan.contexts, {}, ranks)[0] >= planner.trie_savings(sorted_orders, {}, ranks)[0]
