"""bench serve, short version, on the two CI vLLM servers (CPM_VLLM_URL, CPM_VLLM_URL_2; `.ci/vllm.sh ci-up`).

A few dozen cross-session requests (blocks shared between requests in different relevance orders), two clients:
no errors, nothing lost, and the proxy's online order gets more of the engines' prefix cache than the original order.
The two servers are the equal bench replicas (17,408 tokens of KV cache each) on the tiny model: ci-up starts them
as `.ci/vllm.sh bench-up` does, on the tiny model instead of the wide bench model (the same tokenizer and KV size).
"""
from __future__ import annotations

import asyncio
import os

import pytest

from cpmemory.bench.loaders import load_synthetic
from cpmemory.bench.serve import run_serve
from cpmemory.bench.serve_run import ServeSettings

pytestmark = pytest.mark.vllm
URLS = (os.environ.get("CPM_VLLM_URL"), os.environ.get("CPM_VLLM_URL_2"))


@pytest.mark.skipif(not all(URLS), reason="CPM_VLLM_URL and CPM_VLLM_URL_2 are not set (.ci/vllm.sh ci-up)")
def test_short_serve_run_on_two_real_replicas():
    trace = load_synthetic(requests=32, blocks_per_request=4, corpus_size=8, block_words=40, seed=7)
    settings = ServeSettings(engines=tuple(URLS), requests=32, concurrency=2, max_tokens=4, timeout_s=120)
    report = asyncio.run(run_serve(trace, settings))
    original, ours = report["strategies"]["original"], report["strategies"]["cpmemory"]
    assert all(report["details"][name]["reset"] == {url: True for url in URLS} for name in ("original", "cpmemory"))
    for figures in (original, ours):
        assert figures["errors"] == 0 and figures["lost_blocks"] == 0
        assert 0 < figures["prompt_tokens"] < 32 * 16384
    assert report["details"]["cpmemory"]["unchecked"] == 0
    assert ours["cached_tokens"] > original["cached_tokens"], report["strategies"]


KV = (os.environ.get("CPM_VLLM_KV_ENDPOINT"), os.environ.get("CPM_VLLM_KV_ENDPOINT_2"))


@pytest.mark.skipif(not all(URLS) or not all(KV), reason="the CI servers' URLs and KV-event endpoints are not set")
def test_engine_priorities_are_accepted_by_the_real_replicas():
    """Both strategies send vLLM's ``priority`` (the replicas run ``--scheduling-policy priority``): the proxy's by
    its KV-event view, ``original-priority``'s by new prompt length; every request is answered, nothing lost."""
    trace = load_synthetic(requests=16, blocks_per_request=4, corpus_size=8, block_words=40, seed=7)
    settings = ServeSettings(engines=tuple(URLS), kv_events=tuple(KV), requests=16, concurrency=4, max_tokens=4,
                             timeout_s=120, proxy_config={"engine_priority": True},
                             strategies=("original-priority", "cpmemory"))
    report = asyncio.run(run_serve(trace, settings))
    for figures in report["strategies"].values():
        assert figures["errors"] == 0 and figures["lost_blocks"] == 0
    assert report["strategies"]["cpmemory"]["cached_tokens"] > 0
