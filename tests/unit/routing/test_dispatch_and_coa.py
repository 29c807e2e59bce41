"""Dispatcher failover and the Chain-of-Agents helper against the mock engine fleet (vLLM-like prefix caches)."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.errors import EngineStatusError, NoHealthyReplicaError
from cpmemory.routing.chain_of_agents import ChainOfAgents, ChainOfAgentsConfig, split_chunks
from cpmemory.routing.dispatch import Dispatcher, RouteHint, engine_priority
from cpmemory.routing.prefix import PromptBlocks, SentPrefixView
from cpmemory.routing.router import RouteDecision, Router

URLS = ["http://r0", "http://r1", "http://r2"]
PAYLOAD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_failover_marks_down_and_counts_nothing_in_flight(fleet) -> None:
    router = Router(URLS)
    failed = []
    dispatcher = Dispatcher(router, fleet, on_failover=failed.append)
    key = "conversation|k"
    first, second, _ = router.ranking(key)
    fleet.set_down([first])
    result = asyncio.run(dispatcher.complete(key, PAYLOAD))
    assert result.decision.url == second and result.failovers == 1
    assert [d.url for d in failed] == [first]
    assert [s.in_flight for s in router.status()] == [0, 0, 0]
    assert not router.status()[URLS.index(first)].healthy
    fleet.set_down(URLS, False)
    asyncio.run(router.probe(fleet.is_healthy))
    assert asyncio.run(dispatcher.complete(key, PAYLOAD)).decision.url == first


def test_every_replica_down_raises_and_client_errors_are_not_retried(fleet) -> None:
    router = Router(URLS)
    dispatcher = Dispatcher(router, fleet)
    fleet.set_down(URLS)
    with pytest.raises(NoHealthyReplicaError):
        asyncio.run(dispatcher.complete("k", PAYLOAD))
    assert router.healthy_count() == 0
    router2 = Router(URLS)
    fleet.set_down(URLS, False)
    fleet.reject_next(400)
    with pytest.raises(EngineStatusError):
        asyncio.run(Dispatcher(router2, fleet).complete("k", PAYLOAD))
    assert router2.healthy_count() == 3 and len(fleet.calls) == 1  # one attempt: a 4xx is not retried


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=400), size=st.integers(1, 50), most=st.one_of(st.none(), st.integers(1, 10)))
def test_split_chunks_loses_nothing(text: str, size: int, most: int | None) -> None:
    chunks = split_chunks(text, size, most)
    assert "".join(chunks) == text
    assert all(chunks)
    if most is not None:
        assert len(chunks) <= most or size * most >= len(text)


def test_chain_of_agents_job_stays_on_one_replica_and_reuses_its_prefix(fleet) -> None:
    dispatcher = Dispatcher(Router(URLS), fleet)
    coa = ChainOfAgents(dispatcher, ChainOfAgentsConfig(chunk_chars=200))
    blocks = [{"id": f"b{i}", "text": f"shared context block {i} " * 30} for i in range(5)]
    text = " ".join(f"sentence {i} of the long input." for i in range(150))
    result = asyncio.run(coa.run("job-1", "Summarise", text, context_blocks=blocks))
    workers = [call for call in result.calls if call.role == "worker"]
    assert len(workers) == len(split_chunks(text, 200)) and result.calls[-1].role == "manager"
    assert len(result.replicas) == 1
    shared_chars = sum(len(b["text"]) for b in blocks)
    assert all(call.cached_tokens >= shared_chars // 4 for call in result.calls[1:])
    assert result.calls[0].cached_tokens < shared_chars // 4
    # the running summary is passed on: each worker's prompt contains the previous worker's output
    prompts = [payload["messages"][1]["content"] for _, payload in fleet.calls]
    for previous, prompt in zip(result.worker_outputs, prompts[1:]):
        assert previous in prompt


def test_many_jobs_spread_over_replicas_and_each_stays_put(fleet) -> None:
    dispatcher = Dispatcher(Router(URLS), fleet)
    coa = ChainOfAgents(dispatcher, ChainOfAgentsConfig(chunk_chars=100))
    jobs = [(f"job-{i}", "task", "word " * 100) for i in range(30)]
    results = asyncio.run(coa.run_many(jobs, concurrency=5))
    assert [r.job_id for r in results] == [job[0] for job in jobs]
    assert all(len(r.replicas) == 1 for r in results)
    assert len(set().union(*(r.replicas for r in results))) == 3


def test_chain_of_agents_fails_over_mid_job(fleet) -> None:
    router = Router(URLS)
    dispatcher = Dispatcher(router, fleet)
    coa = ChainOfAgents(dispatcher, ChainOfAgentsConfig(chunk_chars=50))
    calls = []
    original = fleet.complete

    async def flaky(base_url, payload, headers, timeout_s):
        calls.append(base_url)
        if len(calls) == 2:
            fleet.set_down([base_url])
        return await original(base_url, payload, headers, timeout_s)

    fleet.complete = flaky
    result = asyncio.run(coa.run("job-x", "task", "word " * 60))
    assert len(result.replicas) == 2 and len(result.calls) == len(split_chunks("word " * 60, 50)) + 1
    assert router.healthy_count() == 2


class _SlowAcceptTransport:
    """An engine that accepts a call only when told to (vLLM under load answers the stream's headers late)."""

    def __init__(self, expected: int) -> None:
        self.accept = asyncio.Event()
        self.all_sent = asyncio.Event()
        self.expected = expected
        self.sent: list[str] = []

    async def complete(self, url, payload, headers, timeout_s):  # type: ignore[no-untyped-def]
        self.sent.append(url)
        if len(self.sent) == self.expected:
            self.all_sent.set()
        await self.accept.wait()
        return {"choices": [{"message": {"role": "assistant", "content": "ok"}}]}


@pytest.mark.parametrize("view_kind", ["sent", "events"])
def test_calls_routed_before_the_first_is_accepted_follow_its_prefix(view_kind: str) -> None:
    """A burst (a hold released, many clients at once) is routed before any engine has answered (and, with KV
    events, before any block is stored): each call's prompt is in the router's view from the moment it is routed,
    so the later calls that share its prefix go to its replica instead of being spread as cold by load. The same
    contract for both views."""
    from cpmemory.routing.prefix import EventPrefixView, SentPrefixView, text_blocks
    from cpmemory.routing.router import RouterConfig

    transport = _SlowAcceptTransport(expected=4)
    view = SentPrefixView(2, 100_000) if view_kind == "sent" else EventPrefixView(2)
    router = Router(["http://r0", "http://r1"], RouterConfig(policy="prefix"), view=view)
    dispatcher = Dispatcher(router, transport)  # type: ignore[arg-type]
    shared = [{"role": "system", "content": "a long shared memory block " * 80}]
    prompts = [text_blocks([*shared, {"role": "user", "content": f"question {i}"}]) for i in range(4)]

    async def burst() -> list[str]:
        calls = [asyncio.create_task(dispatcher.complete(f"q{i}", PAYLOAD, hint=RouteHint(prompt=prompt)))
                 for i, prompt in enumerate(prompts)]
        await asyncio.wait_for(transport.all_sent.wait(), timeout=5)
        transport.accept.set()
        return [result.decision.reason for result in await asyncio.gather(*calls)]

    reasons = asyncio.run(burst())
    assert len(set(transport.sent)) == 1, transport.sent
    assert reasons == ["cold", "prefix", "prefix", "prefix"]


def test_a_fleet_marked_down_by_a_passing_failure_is_checked_before_a_call_is_refused(fleet, caplog,
                                                                                         monkeypatch) -> None:
    """One failed open per replica (a burst, a blip) marks the whole fleet down; the engines are up, so the next call
    checks them and is served instead of answering no_healthy_replica until the periodic probe."""
    import cpmemory.routing.dispatch as dispatch

    clock = [100.0]
    monkeypatch.setattr(dispatch.time, "monotonic", lambda: clock[0])
    router = Router(URLS)
    dispatcher = Dispatcher(router, fleet)
    for url in URLS:
        fleet.fleet.engine(url).fail_next(1, status=503)  # a gateway error: unreachable, the replica goes down
    with caplog.at_level("WARNING", logger="cpmemory.routing.dispatch"):
        with pytest.raises(NoHealthyReplicaError):  # this call tried all three: it never retries one
            asyncio.run(dispatcher.complete("k", PAYLOAD))
        assert router.healthy_count() == 3  # ... but its last step checked them, and they answered
    marked = [record.getMessage() for record in caplog.records if record.getMessage().startswith("engine replica")]
    assert len(marked) == 3 and all("503" in message for message in marked)  # each outage logged, with its cause
    assert any("back in rotation" in record.getMessage() for record in caplog.records)
    for url in URLS:
        router.mark_down(url)  # marked down by another call's failures
    clock[0] += dispatch.REVIVE_INTERVAL_S
    result = asyncio.run(dispatcher.complete("k", PAYLOAD))
    assert result.failovers == 0 and router.healthy_count() == 3


def test_a_fleet_really_down_is_refused_at_once_and_checked_at_most_once_a_second(fleet, monkeypatch) -> None:
    import cpmemory.routing.dispatch as dispatch

    router = Router(URLS)
    dispatcher = Dispatcher(router, fleet)
    checks: list[str] = []
    check = fleet.is_healthy

    async def is_healthy(url: str) -> bool:
        checks.append(url)
        return await check(url)

    monkeypatch.setattr(fleet, "is_healthy", is_healthy)
    fleet.set_down(URLS)
    clock = [100.0]
    monkeypatch.setattr(dispatch.time, "monotonic", lambda: clock[0])

    async def calls(n: int) -> list:
        return await asyncio.gather(*(dispatcher.complete(f"k{i}", PAYLOAD) for i in range(n)), return_exceptions=True)

    results = asyncio.run(calls(5))
    assert all(isinstance(result, NoHealthyReplicaError) for result in results)
    assert sorted(checks) == sorted(URLS)  # one check of the fleet for the five calls
    asyncio.run(calls(3))
    assert len(checks) == 3  # within the interval: refused without another check
    clock[0] += dispatch.REVIVE_INTERVAL_S
    fleet.set_down(URLS, False)
    assert asyncio.run(dispatcher.complete("k", PAYLOAD)).failovers == 0  # checked again, and back


def _prefix_dispatcher(fleet, priority: bool) -> tuple[Dispatcher, SentPrefixView]:
    view = SentPrefixView(len(URLS), 10_000)
    return Dispatcher(Router(URLS, view=view), fleet, priority=priority), view


def test_engine_priority_is_the_tokens_the_chosen_replica_must_still_compute(fleet) -> None:
    dispatcher, view = _prefix_dispatcher(fleet, priority=True)
    first = PromptBlocks((1, 2, 3, 4), 16, 70)
    result = asyncio.run(dispatcher.complete("prefix|a", PAYLOAD, hint=RouteHint(first)))
    assert fleet.calls[-1][1]["priority"] == 70  # nothing cached anywhere: the whole prompt
    # a prompt sharing three blocks goes where they are cached and counts only the rest (100 - 3 x 16)
    second = PromptBlocks((1, 2, 3, 9, 10, 11), 16, 100)
    again = asyncio.run(dispatcher.complete("prefix|b", PAYLOAD, hint=RouteHint(second)))
    assert again.decision.index == result.decision.index and again.decision.cached_blocks == 3
    assert fleet.calls[-1][1]["priority"] == 100 - 3 * 16
    assert view.matched_blocks(result.decision.index, second) == 6  # recorded as before


def test_engine_priority_without_blocks_counts_what_follows_the_last_answer(fleet) -> None:
    dispatcher, _ = _prefix_dispatcher(fleet, priority=True)
    turn = {"model": "m", "messages": [
        {"role": "system", "content": "s" * 400},
        {"role": "user", "content": "u" * 800},
        {"role": "assistant", "content": "a" * 400},
        {"role": "user", "content": "q" * 120},
    ]}
    asyncio.run(dispatcher.complete("conversation|c", turn, hint=RouteHint(None, sticky=True)))
    assert fleet.calls[-1][1]["priority"] == 120 // 4
    assert engine_priority(RouteDecision("http://r0", 0, "cold"), None, PAYLOAD) == len("hi") // 4


def test_engine_priority_is_off_by_default_and_a_callers_own_priority_is_kept(fleet) -> None:
    dispatcher, _ = _prefix_dispatcher(fleet, priority=False)
    asyncio.run(dispatcher.complete("k", PAYLOAD, hint=RouteHint(PromptBlocks((1,), 16, 20))))
    assert "priority" not in fleet.calls[-1][1]  # engines without priority scheduling may refuse one
    dispatcher, _ = _prefix_dispatcher(fleet, priority=True)
    asyncio.run(dispatcher.complete("k", {**PAYLOAD, "priority": -5}, hint=RouteHint(PromptBlocks((1,), 16, 20))))
    assert fleet.calls[-1][1]["priority"] == -5
    assert "priority" not in PAYLOAD  # the caller's payload is not changed
