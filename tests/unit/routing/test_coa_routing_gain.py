"""Agent-aware routing vs per-call routing for Chain-of-Agents jobs on four mock vLLM replicas (LRU prefix caches).

Prints the figures (run with ``pytest -s``); asserts only the direction: job affinity serves more prompt tokens
from cache than routing each call on its own.
"""
from __future__ import annotations

import asyncio

from cpmemory.routing.chain_of_agents import ChainOfAgents, ChainOfAgentsConfig
from cpmemory.routing.dispatch import Dispatcher
from cpmemory.routing.router import Router
from cpmemory.testing.fleet import MockFleet

REPLICAS = 4
JOBS = 16


def _run(affinity: str) -> tuple[int, int, float]:
    fleet = MockFleet([f"http://r{i}" for i in range(REPLICAS)], block_size=16, capacity_blocks=1200)

    async def main() -> tuple[int, int, float]:
        transport = fleet.chat_transport()
        dispatcher = Dispatcher(Router(fleet.urls), transport)
        coa = ChainOfAgents(dispatcher, ChainOfAgentsConfig(chunk_chars=600, affinity=affinity))
        limit = asyncio.Semaphore(8)

        async def job(number: int):
            # each job has its own retrieved context, shared by its workers and its manager
            context = [{"id": f"c{number}-{i}", "text": f"context {i} of job {number}. " * 40} for i in range(3)]
            async with limit:
                return await coa.run(f"job-{number}", f"task {number}",
                                     f"part of the long input of job {number}. " * 60, context_blocks=context)

        results = await asyncio.gather(*(job(number) for number in range(JOBS)))
        await transport.aclose()
        cached = sum(r.cached_tokens for r in results)
        prompt = sum(r.prompt_tokens for r in results)
        per_job = sum(len(r.replicas) for r in results) / len(results)
        return cached, prompt, per_job

    return asyncio.run(main())


def test_job_affinity_reuses_more_prefix_than_per_call_routing() -> None:
    job_cached, prompt, job_spread = _run("job")
    call_cached, prompt_again, call_spread = _run("call")
    assert prompt == prompt_again
    print(f"\nChain-of-Agents, {JOBS} jobs on {REPLICAS} replicas: prompt tokens {prompt}; cached with job affinity "
          f"{job_cached} ({job_cached / prompt:.1%}, {job_spread:.1f} replicas/job), per-call routing "
          f"{call_cached} ({call_cached / prompt:.1%}, {call_spread:.1f} replicas/job); uncached tokens "
          f"{(prompt - call_cached) / (prompt - job_cached):.2f}x more without affinity")
    assert job_spread == 1.0 and call_spread > 1.0
    assert job_cached > call_cached
