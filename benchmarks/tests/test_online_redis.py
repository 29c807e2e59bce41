"""bench replay --online --workers K on the real Redis: K workers sharing one Redis decide as one facade."""
from __future__ import annotations

import pytest

from cpmemory.bench.loaders import load_synthetic
from cpmemory.bench.trace import Trace
from cpmemory_benchmarks.replay import ReplaySettings, run_replay
from tests.redis_env import redis_url


@pytest.fixture(scope="module")
def trace():
    return load_synthetic(requests=150, blocks_per_request=6, corpus_size=60, seed=3)


@pytest.mark.redis
def test_k_workers_on_one_redis_decide_as_one_facade(trace):
    pytest.importorskip("redis")

    small = Trace("t", trace.requests[:60])
    settings = ReplaySettings(capacity="20%", strategies=("original",))
    one = run_replay(small, settings, online_window=1).online.results["cpmemory"]
    shared = run_replay(small, settings, online_window=1, online_workers=3, redis_url=redis_url())
    assert shared.online.workers == 3
    assert shared.online.results["cpmemory"].cached_tokens == one.cached_tokens  # same decisions as in memory
    assert shared.online.results["cpmemory"].violations == []
