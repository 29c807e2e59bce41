"""bench serve without engines: selection, the replay loop (order, concurrency, deadlines, failures), figures, loaders."""
from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.bench.loaders import load_locomo_sessions, load_synthetic
from cpmemory.bench.serve import report_json
from cpmemory.bench.serve_clients import Sent, lines_of, read_stream
from cpmemory.bench.serve_run import FIGURES, ServeSettings, StrategyRun, percentile, replay, select_jobs
from cpmemory.errors import EngineError

DATA = next((p for p in (Path.cwd() / ".." / "shared" / "data", Path("/work/shared/data")) if p.is_dir()), None)


def settings_of(**fields) -> ServeSettings:
    return ServeSettings(engines=("http://127.0.0.1:1",), **fields)


def multi_turn_trace(sessions: int = 5, turns: int = 4):
    return load_synthetic(requests=sessions * turns, blocks_per_request=3, corpus_size=20, block_words=10,
                          turns_per_session=turns)


def test_select_takes_whole_sessions_in_turn_order_and_cuts_the_last():
    trace = multi_turn_trace(sessions=5, turns=4)
    jobs = select_jobs(trace, settings_of(requests=10), "r")
    assert [len(session) for session in jobs] == [4, 4, 2]
    for session in jobs:
        assert [job.request.turn for job in session] == sorted(job.request.turn for job in session)
        assert len({job.conversation for job in session}) == 1
    assert len(select_jobs(trace, settings_of(requests=100, max_turns=2), "r")[0]) == 2


def test_independent_requests_get_a_conversation_each():
    trace = load_synthetic(requests=12, blocks_per_request=3, corpus_size=10, block_words=5)
    jobs = select_jobs(trace, settings_of(requests=8), "r")
    conversations = [job.conversation for session in jobs for job in session]
    assert len(conversations) == 8 and len(set(conversations)) == 8


def test_poisson_arrivals_are_seeded_and_increasing():
    trace = multi_turn_trace()
    first = [job.arrival_s for s in select_jobs(trace, settings_of(rate=4.0, seed=3), "a") for job in s]
    again = [job.arrival_s for s in select_jobs(trace, settings_of(rate=4.0, seed=3), "b") for job in s]
    assert first == again and len(set(first)) == len(first)
    assert max(first) == pytest.approx(sum(b - a for a, b in zip(sorted(first), sorted(first)[1:])))


class FakeClient:
    """Records the order of sends and the peak of concurrent sends; optional hangs and failures."""

    def __init__(self, delay_s: float = 0.01, hang: set[str] = frozenset(), fail: set[str] = frozenset()) -> None:
        self.delay_s, self.hang, self.fail = delay_s, hang, fail
        self.order: dict[str, list[str]] = defaultdict(list)
        self.in_flight = self.peak = 0

    async def send(self, conversation, blocks, query, multi_turn):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            self.order[conversation].append(query)
            if query in self.hang:
                await asyncio.Event().wait()  # never answers: the request's deadline ends it
            await asyncio.sleep(0)  # the others run meanwhile; ``delay_s`` is the latency it reports
            if query in self.fail:
                raise EngineError("replica on fire")
            return Sent(0.001, self.delay_s, 100, 50, 0, None)
        finally:
            self.in_flight -= 1


def test_replay_keeps_turn_order_and_bounds_concurrency():
    trace = multi_turn_trace(sessions=6, turns=3)
    sessions = select_jobs(trace, settings_of(requests=18), "r")
    client = FakeClient()
    outcomes, wall = asyncio.run(replay(client, sessions, True, settings_of(requests=18, concurrency=2)))
    assert len(outcomes) == 18 and client.peak == 2 and wall > 0
    for session in sessions:
        assert client.order[session[0].conversation] == [job.request.query for job in session]


def test_a_hung_request_ends_at_its_deadline_and_the_session_goes_on():
    trace = multi_turn_trace(sessions=2, turns=3)
    sessions = select_jobs(trace, settings_of(requests=6), "r")
    hung, failing = sessions[0][0].request.query, sessions[1][1].request.query
    client = FakeClient(hang={hung}, fail={failing})
    outcomes, _ = asyncio.run(replay(client, sessions, True, settings_of(requests=6, timeout_s=0.3)))
    errors = {o.job.request.query: o.error for o in outcomes if o.error}
    assert errors.keys() == {hung, failing}
    assert errors[hung].startswith("timeout") and "replica on fire" in errors[failing]
    run = StrategyRun("cpmemory", outcomes=outcomes, wall_s=1.0)
    figures = run.figures()
    assert tuple(figures) == FIGURES and figures["errors"] == 2 and figures["prompt_tokens"] == 400
    assert run.details()["errors_by_kind"] == {"timeout": 1, "EngineError": 1}


def test_rate_mode_sends_no_turn_before_its_arrival():
    trace = multi_turn_trace(sessions=3, turns=2)
    chosen = settings_of(requests=6, rate=20.0, seed=1)
    sessions = select_jobs(trace, chosen, "r")
    outcomes, _ = asyncio.run(replay(FakeClient(delay_s=0.0), sessions, True, chosen))
    assert all(o.started_s >= o.job.arrival_s - 1e-3 for o in outcomes)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50), st.floats(0.01, 1.0))
@settings(max_examples=50, deadline=None)
def test_percentile_is_an_element_with_enough_mass_below(values, fraction):
    value = percentile(values, fraction)
    assert value in values
    assert sum(v <= value for v in values) >= fraction * len(values) - 1e-9


def test_report_speedup_and_exact_strategy_keys():
    trace = multi_turn_trace(sessions=1, turns=2)
    job = select_jobs(trace, settings_of(requests=2), "r")[0][0]
    from cpmemory.bench.serve_run import Outcome

    def run(name, ttft):
        return StrategyRun(name, [Outcome(job, 0.0, ttft, ttft, 10, 5)], wall_s=2.0)

    report = report_json(trace, settings_of(), {"original": run("original", 300.0), "cpmemory": run("cpmemory", 100.0)},
                         [], 1)
    assert report["ttft_mean_speedup"] == 3.0
    assert report["engine_ttft_mean_speedup"] is None  # no engine counters scraped
    assert all(tuple(s) == FIGURES for s in report["strategies"].values())
    json.dumps(report)
    original, ours = run("original", 300.0), run("cpmemory", 100.0)
    original.engine_raw = {"ttft_s": 16.0, "requests": 64.0}  # vLLM's own TTFT: 250 ms against 125 ms
    ours.engine_raw = {"ttft_s": 8.0, "requests": 64.0}
    ours.proxy_raw = {"overhead_count": 64.0, "overhead_s": 1.28, "fit_wait_s": 3.2, "fit_waits": 4.0}
    report = report_json(trace, settings_of(), {"original": original, "cpmemory": ours}, [], 1)
    assert report["engine_ttft_mean_speedup"] == 2.0
    proxy = report["details"]["cpmemory"]["proxy"]
    assert (proxy["fit_wait_mean_ms"], proxy["fit_wait_per_request_ms"], proxy["overhead_mean_ms"]) == (800.0, 50.0, 20.0)


async def _chunks(parts):
    for part in parts:
        yield part


def test_stream_reader_splits_any_chunking_and_needs_an_end():
    body = (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\ndata: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
            b'data: {"choices":[{"delta":{},"finish_reason":"length"}],"usage":{"prompt_tokens":9,'
            b'"prompt_tokens_details":{"cached_tokens":4}}}\n\ndata: [DONE]\n\n')
    for size in (1, 7, len(body)):
        parts = [body[i:i + size] for i in range(0, len(body), size)]
        accumulator = asyncio.run(read_stream(_chunks(parts), time.perf_counter()))
        assert "".join(accumulator.parts) == "Hi" and accumulator.usage["prompt_tokens"] == 9
    with pytest.raises(EngineError):
        asyncio.run(read_stream(_chunks([body[:60]]), time.perf_counter()))
    with pytest.raises(EngineError):
        asyncio.run(read_stream(_chunks([b'data: {"error": {"message": "x"}}\n']), time.perf_counter()))

    async def collect():
        return [line async for line in lines_of(_chunks([b"a\nb", b"c\n", b"d"]))]

    assert asyncio.run(collect()) == ["a", "bc", "d"]


@pytest.mark.skipif(DATA is None, reason="no ../shared/data on this machine")
def test_locomo_sessions_are_whole_sessions_of_the_own_conversation():
    trace = load_locomo_sessions(DATA, top_k=4)
    assert not trace.multi_turn and len(trace.requests) > 1000
    first = trace.requests[0]
    assert len(first.blocks) == 4 and all(block.id.startswith("conv-26:session_") for block in first.blocks)
    assert all(block.text.startswith("Session ") and block.text.count("\n") >= 5 for block in first.blocks)


def test_synthetic_fixed_block_length():
    trace = load_synthetic(requests=5, blocks_per_request=3, corpus_size=10, block_words=80, name="synthetic300")
    assert trace.name == "synthetic300"
    assert {len(block.text.split(". ", 1)[1].split()) for r in trace.requests for block in r.blocks} == {80}


def test_rounds_pool_outcomes_losses_and_resets():
    from cpmemory.bench.serve_run import Outcome

    trace = multi_turn_trace(sessions=1, turns=2)
    job = select_jobs(trace, settings_of(requests=2), "r")[0][0]
    total = StrategyRun("cpmemory")
    total.merge(StrategyRun("cpmemory", [Outcome(job, 0.0, 100.0, 120.0, 10, 5)], wall_s=1.0, reset={"u": True},
                            lost_blocks=1, load_average=[(1.0, 2.0)]))
    total.merge(StrategyRun("cpmemory", [Outcome(job, 0.0, 300.0, 320.0, 10, 5)], wall_s=3.0, reset={"u": False},
                            load_average=[(2.0, 3.0)]))
    figures = total.figures()
    assert figures["ttft_mean_ms"] == 200.0 and figures["throughput_rps"] == 0.5 and figures["lost_blocks"] == 1
    assert total.reset == {"u": False} and total.details()["machine_load_average"] == [[1.0, 2.0], [2.0, 3.0]]


VLLM_METRICS = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 12.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 3.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 4.0
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 6.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 9000.0
vllm:prompt_tokens_cached_total{engine="0",model_name="tiny"} 4000.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="tiny"} 5000.0
vllm:num_preemptions_total{engine="0",model_name="tiny"} 1.0
"""


def test_engine_counters_of_a_strategy_are_the_difference_of_two_scrapes_pooled_over_rounds():
    from cpmemory.bench.serve_metrics import ENGINE_SAMPLES, add, delta, engine_summary, totals

    before = totals(VLLM_METRICS, ENGINE_SAMPLES)
    assert before["ttft_s"] == 12.5 and before["requests"] == 10.0  # buckets are not sums
    after = totals(VLLM_METRICS.replace("12.5", "22.5").replace("_count{engine=\"0\",model_name=\"tiny\"} 10.0",
                                                                 "_count{engine=\"0\",model_name=\"tiny\"} 14.0"),
                   ENGINE_SAMPLES)
    one = delta(before, after)
    assert one is not None and one["requests"] == 4.0 and one["ttft_s"] == 10.0 and one["prompt_tokens"] == 0.0
    pooled = add(add(None, one, first=True), one, first=False)
    summary = engine_summary(pooled)
    assert summary is not None and summary["requests"] == 8 and summary["ttft_mean_ms"] == 2500.0
    assert summary["queue_mean_ms"] == 0.0 and summary["prefill_mean_ms"] == 0.0
    assert delta(None, after) is None and add(None, one, first=False) is None  # a failed scrape stays unknown
    assert engine_summary(None) is None


def test_the_engine_summary_says_how_the_work_was_spread_over_the_engines():
    from cpmemory.bench.serve_metrics import ENGINE_SAMPLES, combine, delta, engine_summary, totals

    idle = totals(VLLM_METRICS, ENGINE_SAMPLES)
    busy = totals(VLLM_METRICS.replace("prefill_time_seconds_sum{engine=\"0\",model_name=\"tiny\"} 6.0",
                                       "prefill_time_seconds_sum{engine=\"0\",model_name=\"tiny\"} 9.0")
                  .replace("computed_tokens_sum{engine=\"0\",model_name=\"tiny\"} 5000.0",
                           "computed_tokens_sum{engine=\"0\",model_name=\"tiny\"} 8000.0"), ENGINE_SAMPLES)
    # engine 0 prefilled 3 s and 3,000 tokens more during the run, engine 1 nothing
    summary = engine_summary(delta(combine([idle, idle]), combine([busy, idle])))
    assert summary is not None and summary["computed_tokens"] == 3000
    assert summary["per_engine"] == [{"prefill_s": 3.0, "queue_s": 0.0, "computed_tokens": 3000},
                                     {"prefill_s": 0.0, "queue_s": 0.0, "computed_tokens": 0}]
    assert summary["prefill_max_over_mean"] == 2.0  # all the work on one of two engines


def test_proxy_counters_group_route_reasons_and_fallbacks():
    from cpmemory.bench.serve_metrics import PROXY_SAMPLES, delta, proxy_summary, totals

    text = """cpmemory_route_decisions_total{reason="affinity",replica="0"} 5.0
cpmemory_route_decisions_total{reason="affinity",replica="1"} 3.0
cpmemory_route_decisions_total{reason="cold",replica="0"} 2.0
cpmemory_fallbacks_total{kind="route_tokenize"} 1.0
cpmemory_middleware_overhead_seconds_sum 0.5
cpmemory_middleware_overhead_seconds_count 10.0
cpmemory_kv_sync_failures 1.0
cpmemory_fit_admissions_total{reason="live"} 7.0
cpmemory_fit_admissions_total{reason="room"} 3.0
cpmemory_fit_wait_seconds_sum 1.5
cpmemory_fit_wait_seconds_count 3.0
cpmemory_gateway_attributions_total{replica="0"} 4.0
cpmemory_gateway_attributions_total{replica="unknown"} 2.0
cpmemory_local_tokenizer 1.0
cpmemory_fit_idle_window_seconds 0.3125
cpmemory_hold_held_total 6.0
cpmemory_hold_seconds_sum 2.0
cpmemory_hold_releases_total{reason="slot",order="planner"} 2.0
cpmemory_hold_releases_total{reason="timeout",order="fcfs"} 1.0
cpmemory_hold_send_timeouts_total 3.0
"""
    after = totals(text, PROXY_SAMPLES)
    summary = proxy_summary(delta({}, after))
    assert summary == {"route_reasons": {"affinity": 8, "cold": 2}, "fallbacks": {"route_tokenize": 1},
                       "overhead_mean_ms": 50.0, "kv_sync_failures": 1, "fit_admissions": {"live": 7, "room": 3},
                       "fit_wait_mean_ms": 500.0, "fit_wait_per_request_ms": 150.0,
                       "gateway_attributions": {"0": 4, "unknown": 2},
                       "fit_idle_window_ms": 312.5, "local_tokenizer": True,
                       "hold_held": 6, "hold_wait_per_request_ms": 200.0, "hold_windows": {"planner": 2, "fcfs": 1},
                       "hold_send_timeouts": 3}
    # states, not counters: found before the run (the same before and after) is still found
    assert proxy_summary(delta(after, after))["local_tokenizer"] is True
    assert proxy_summary(delta(after, after))["fit_idle_window_ms"] == 312.5


def test_by_turn_splits_tokens_and_ttft_by_turn_number():
    from cpmemory.bench.serve_run import Outcome

    trace = multi_turn_trace(sessions=2, turns=2)
    sessions = select_jobs(trace, settings_of(requests=4), "r")
    outcomes = [Outcome(job, 0.0, 100.0 * job.request.turn, 1.0, 10 * job.request.turn, job.request.turn)
                for turns in sessions for job in turns]
    outcomes.append(Outcome(sessions[0][0], 0.0, error="timeout"))
    rows = StrategyRun("cpmemory", outcomes).by_turn()
    first, second = (str(turn) for turn in sorted({job.request.turn for turns in sessions for job in turns}))
    assert rows[first]["requests"] == 2 and rows[second]["prompt_tokens"] == 2 * 10 * int(second)
    assert rows[second]["ttft_mean_ms"] == 100.0 * int(second)


async def test_the_bench_proxy_has_the_prompt_budget_and_finds_the_engines_tokenizer_as_cpmemory_serve_does():
    """The in-process proxy records what reaches the engines through a wrapping transport; the wrapper must still
    give the proxy its HTTP client, or the proxy would run without the prompt budget and without looking for the
    engine's tokenizer (what ``bench serve`` measured before)."""
    from cpmemory.bench.load import RecordingTransport
    from cpmemory.routing.transport import HttpxChatTransport
    from cpmemory.server.app import ServerConfig, create_app

    inner = HttpxChatTransport()
    recording = RecordingTransport(inner)
    app = create_app(ServerConfig(engines=["http://127.0.0.1:9"]), transport=recording)
    assert recording.client is inner.client
    assert app.state.service.engine_budget is not None
    assert not app.state.service.dispatcher.priority
    prioritised = create_app(ServerConfig(engines=["http://127.0.0.1:9"], engine_priority=True), transport=recording)
    assert prioritised.state.service.dispatcher.priority
    await inner.aclose()


@pytest.mark.parametrize("policy", ["session", "affinity"])
async def test_the_original_keeps_each_conversation_on_one_replica_and_session_deals_them_evenly(policy):
    """The original baseline's conversation affinity: every turn of a conversation on one replica; with ``session``
    (the default) eight conversations started together land 4:4 whatever their ids hash to."""
    from cpmemory.bench.serve_clients import DirectClient
    from cpmemory.core.blocks import Block
    from cpmemory.testing.fleet import MockFleet

    fleet = MockFleet(2)
    client = DirectClient(fleet.urls, model="tiny", max_tokens=4, timeout_s=10.0, system_prompt="Answer.",
                          transport=fleet.async_transport(), policy=policy)
    try:
        block = (Block("d", "a passage"),)
        replicas: dict[str, set[int]] = defaultdict(set)
        for turn in range(3):
            sent = await asyncio.gather(*(client.send(f"c{i}", block, f"question {turn}", True) for i in range(8)))
            for index, one in enumerate(sent):
                replicas[f"c{index}"].add(one.replica)
        assert all(len(used) == 1 for used in replicas.values())  # sticky
        firsts = [next(iter(used)) for used in replicas.values()]
        if policy == "session":
            assert sorted(firsts.count(replica) for replica in (0, 1)) == [4, 4]
        assert len(client.history["c0"]) == 6  # three user turns and three answers
    finally:
        await client.aclose()


async def test_original_priority_sends_the_new_prompt_length_and_the_original_none():
    """The ``original-priority`` ablation: vLLM's priority by the tokens after the conversation's last answer
    (the proxy's rule without a cache view); plain ``original`` sends no priority."""
    from cpmemory.bench.serve_clients import DirectClient
    from cpmemory.core.blocks import Block
    from cpmemory.testing.fleet import MockFleet

    fleet = MockFleet(2)
    for priority in (False, True):
        client = DirectClient(fleet.urls, model="tiny", max_tokens=4, timeout_s=10.0, system_prompt="Answer.",
                              transport=fleet.async_transport(), priority=priority)
        try:
            for turn in range(2):
                await client.send("c", (Block("d", "a passage " * 20),), f"question {turn}", True)
        finally:
            await client.aclose()
    plain, first, second = fleet.calls[0][1], fleet.calls[2][1], fleet.calls[3][1]
    assert "priority" not in plain
    assert first["priority"] == sum(len(m["content"]) for m in first["messages"]) // 4  # nothing answered yet
    assert second["priority"] == len(second["messages"][-1]["content"]) // 4  # only what follows the answer


@pytest.mark.parametrize("strategy", ["cpmemory-nofit", "cpmemory-nomove", "cpmemory-nosplit", "cpmemory-nohold"])
def test_ablations_start_their_own_proxy_and_unknown_strategies_are_refused(strategy):
    from cpmemory.bench.serve_run import ServeSettings, validate
    from cpmemory.errors import InvalidInputError

    validate(ServeSettings(engines=["http://e"], strategies=["original", strategy]))
    with pytest.raises(InvalidInputError, match="starts its own proxy"):
        validate(ServeSettings(engines=["http://e"], proxy="http://p", strategies=[strategy]))
    with pytest.raises(InvalidInputError, match="unknown strategies"):
        validate(ServeSettings(engines=["http://e"], strategies=["cpmemory-nothing"]))
    with pytest.raises(InvalidInputError, match="in-process proxy"):
        validate(ServeSettings(engines=["http://e"], proxy="http://p", strategies=["cpmemory"], hold="window"))
    with pytest.raises(InvalidInputError, match="in-process proxy"):
        validate(ServeSettings(engines=["http://e"], proxy="http://p", strategies=["cpmemory"],
                               proxy_config={"fit": {"fill": 0.5}}))
    with pytest.raises(InvalidInputError, match="needs --hold pick"):
        validate(ServeSettings(engines=["http://e"], strategies=["cpmemory", "cpmemory-nopick"], hold="window"))
    validate(ServeSettings(engines=["http://e"], strategies=["cpmemory", "cpmemory-nopick"], hold="pick"))


def test_the_in_process_proxy_is_built_from_the_serve_config_with_each_ablation():
    from pydantic import ValidationError

    from cpmemory.bench.serve import proxy_config
    from cpmemory.bench.serve_run import ServeSettings

    settings = ServeSettings(engines=["http://e0", "http://e1"], hold="pick",
                             proxy_config={"fit": {"fill": 0.5}, "experimental": {"fit_learn_idle": False}})
    base = proxy_config(settings, cache_tokens=4096)
    assert base.hold.policy == "pick" and base.fit.fill == 0.5 and not base.experimental.fit_learn_idle
    assert base.replica_cache_tokens == 4096 and base.engines == ["http://e0", "http://e1"]
    assert not proxy_config(settings, ablation="cpmemory-nofit").fit.enabled
    assert not proxy_config(settings, ablation="cpmemory-nomove").experimental.fit_move
    assert not proxy_config(settings, ablation="cpmemory-nosplit").experimental.hold_split
    assert proxy_config(settings, ablation="cpmemory-nohold").hold.settings() is None
    windows = proxy_config(settings, ablation="cpmemory-nopick").hold
    assert windows.policy == "window" and windows.settings() == base.hold.settings()  # the pick's bounds, whole windows
    with pytest.raises(ValidationError, match="pick"):  # the config's own rule: not behind a gateway
        proxy_config(ServeSettings(engines=["http://e"], upstream="http://gw", hold="pick"))
    with pytest.raises(ValidationError):  # an unknown key of the file is refused
        proxy_config(ServeSettings(engines=["http://e"], proxy_config={"fit": {"fil": 0.5}}))


def test_a_per_request_record_says_where_each_request_went_and_what_it_found_cached():
    from cpmemory.bench.serve_run import Outcome, request_record

    trace = multi_turn_trace(sessions=1, turns=2)
    first, second = select_jobs(trace, settings_of(requests=2), "r")[0]
    answered = request_record("cpmemory", Outcome(second, 1.23456, 80.0, 95.5, 400, 300, replica=1, failovers=1), 2.0)
    assert answered["conversation"] == second.conversation and answered["turn"] == second.request.turn
    assert (answered["replica"], answered["started_s"], answered["ttft_ms"]) == (1, 1.2346, 80.0)
    assert answered["cached_share"] == 0.75 and answered["failovers"] == 1 and answered["rate"] == 2.0
    assert answered["error"] is None and json.loads(json.dumps(answered)) == answered
    failed = request_record("original", Outcome(first, 0.0, error="timeout: no answer"))
    assert failed["ttft_ms"] is None and failed["cached_share"] is None and failed["error"].startswith("timeout")
    assert "rate" not in failed
