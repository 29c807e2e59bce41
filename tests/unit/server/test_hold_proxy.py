"""The hold-and-release queue end to end: the real proxy app (real facade, in-memory store) in front of a mock
engine, with a bound of one request in flight. While the first request runs, the next ones are held; when it ends
they are released together, prepared in the window planner's order and sent in that order, and every block reaches
the engine."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from cpmemory.core.blocks import Block
from cpmemory.core.invariants import check_no_loss
from cpmemory.core.scheduling import ReleasePlan
from cpmemory.facade import AsyncCpMemory
from cpmemory.server.app import ServerConfig, create_app
from cpmemory.server.clock import ManualClock
from cpmemory.server.config import ExperimentalConfig, FitConfig, HoldConfig
from cpmemory.testing.fleet import MockFleet

TEXTS = {i: f"Document {i}: " + f"fact {i} about the topic. " * (6 + 5 * (i % 4)) for i in range(12)}
FIRST = [0, 5]
WINDOW = [[3, 4, 5], [9, 6], [4, 5, 8], [6, 9, 10], [11, 1]]  # held together; they share blocks


def blocks(ids: list[int]) -> list[dict[str, str]]:
    return [{"id": f"doc-{i}", "text": TEXTS[i]} for i in ids]


def body(conversation: str, ids: list[int], stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 8, "stream": stream,
            "messages": [{"role": "user", "content": f"Question of {conversation}?"}],
            "cpmemory": {"conversation_id": conversation, "blocks": blocks(ids)}}


class GatedTransport:
    """The fleet's transport, except that the first chat call waits for ``gate`` (a long-running request)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.client = inner.client  # the proxy's budget probe (/v1/models) uses it, as with the real transport
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.calls = 0
        self.gated = 1  # how many first calls wait for the gate

    async def _wait_first(self) -> None:
        self.calls += 1
        if self.calls <= self.gated:
            self.entered.set()
            await self.gate.wait()

    async def complete(self, url: str, payload: Any, headers: Any, timeout_s: float) -> Any:
        await self._wait_first()
        return await self.inner.complete(url, payload, headers, timeout_s)

    async def open_stream(self, url: str, payload: Any, headers: Any, timeout_s: float) -> Any:
        await self._wait_first()
        return await self.inner.open_stream(url, payload, headers, timeout_s)

    async def is_healthy(self, url: str) -> bool:
        return await self.inner.is_healthy(url)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ReversingMemory(AsyncCpMemory):
    """A facade whose window planner runs the window backwards (today's planner keeps the arrival order, so this
    shows the proxy follows whatever order the planner gives)."""

    def release_plan(self, requests, *, tenant="default", cache_tokens=None, lanes=1):
        plan = super().release_plan(requests, tenant=tenant, cache_tokens=cache_tokens, lanes=lanes)
        return ReleasePlan(tuple(reversed(plan.order)), plan.lanes)


def admission(*, max_in_flight: int | None = 1, hold_ms: float = 1000.0, hold_fit: bool = False,
              hold_pick: bool = False, hold_split: bool = True, fit: bool = True) -> dict[str, Any]:
    """The config sections of a hold: ``window`` (``pick`` with ``hold_pick``) with these bounds."""
    return {"hold": HoldConfig(policy="pick" if hold_pick else "window", max_in_flight=max_in_flight,
                               token_bound=hold_fit, timeout_ms=hold_ms),
            "fit": FitConfig(enabled=fit), "experimental": ExperimentalConfig(hold_split=hold_split)}


class HeldProxy:
    def __init__(self, memory: AsyncCpMemory, replicas: int = 1, **config: Any) -> None:
        self.fleet = MockFleet(replicas, block_size=16, capacity_blocks=4096)
        self.transport = GatedTransport(self.fleet.chat_transport())
        self.memory = memory
        # a long timeout by default: releases come from slots unless a test says so
        sections = admission(**{key: config.pop(key) for key in list(config)
                                if key in ("max_in_flight", "hold_ms", "hold_fit", "hold_pick", "hold_split", "fit")})
        self.app = create_app(ServerConfig(engines=self.fleet.urls, **sections, **config), memory=memory,
                              transport=self.transport)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://proxy",
                                        timeout=30)

    @property
    def hold(self) -> Any:
        return self.app.state.service.hold

    def post(self, payload: dict[str, Any]) -> asyncio.Future[httpx.Response]:
        return asyncio.ensure_future(self.client.post("/v1/chat/completions", json=payload))

    async def until(self, condition: Any) -> None:
        """Let the loop run until ``condition()`` holds (no time passes: what it waits for needs no timer)."""
        for _ in range(20_000):
            if condition():
                return
            await asyncio.sleep(0)
        raise AssertionError("condition not reached")

    def sent_conversations(self) -> list[str]:
        """The conversation of each chat request that reached the engine, in arrival order (from its question)."""
        return [call["messages"][-1]["content"].rsplit("Question of ", 1)[1].split("?")[0]
                for _, call in self.fleet.calls]

    async def metric(self, name: str) -> dict[str, float]:
        text = (await self.client.get("/metrics")).text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line.startswith(name)}

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.transport.aclose()


@pytest.fixture
async def held_proxy():
    made: list[HeldProxy] = []

    def factory(memory: AsyncCpMemory | None = None, replicas: int = 1, **config: Any) -> HeldProxy:
        proxy = HeldProxy(memory or AsyncCpMemory(), replicas, **config)
        made.append(proxy)
        return proxy

    yield factory
    for proxy in made:
        await proxy.aclose()


async def hold_window(proxy: HeldProxy, window: list[list[int]], stream: bool = False) -> list[Any]:
    """Start the first request (it blocks at the engine), then the window's (held); return their futures."""
    first = proxy.post(body("first", FIRST))
    await asyncio.wait_for(proxy.transport.entered.wait(), 10)
    held = []
    for number, ids in enumerate(window):
        held.append(proxy.post(body(f"w{number}", ids, stream=stream)))
        await proxy.until(lambda count=number + 1: proxy.hold.waiting == count)
    return [first, *held]


def prompt_order(info: dict[str, Any]) -> list[str]:
    shown = [d for d in info["decisions"] if d["prompt_position"] is not None]
    return [d["block_id"] for d in sorted(shown, key=lambda d: d["prompt_position"])]


async def reference_orders(window: list[list[int]], planned: bool) -> list[list[str]]:
    """The block orders a fresh facade gives the window after the first request: planned together or one by one."""
    memory = AsyncCpMemory()
    await memory.prepare("first", "q", blocks(FIRST))
    if planned:
        memory.release_order([blocks(ids) for ids in window])
    return [(await memory.prepare(f"w{number}", "q", blocks(ids))).prompt_order for number, ids in enumerate(window)]


async def test_held_requests_are_planned_together_sent_in_order_and_none_is_lost(held_proxy):
    proxy = held_proxy()
    futures = await hold_window(proxy, WINDOW)
    assert len(proxy.fleet.calls) == 0 and proxy.hold.admitted == 1
    proxy.transport.gate.set()
    responses = await asyncio.gather(*futures)
    assert [response.status_code for response in responses] == [200] * len(responses)
    # released when the first ended, in the planner's order (today's planner: arrival order)
    assert proxy.sent_conversations() == ["first"] + [f"w{number}" for number in range(len(WINDOW))]
    for (_, sent), ids in zip(proxy.fleet.calls, [FIRST, *WINDOW]):
        assert check_no_loss(blocks(ids), sent["messages"]).ok
    # each was prepared after its release, with the window planned together: the orders the planner gives the
    # window, not the ones preparing them one by one at arrival would give
    orders = [prompt_order(response.json()["cpmemory"]) for response in responses[1:]]
    assert orders == await reference_orders(WINDOW, planned=True)
    assert orders != await reference_orders(WINDOW, planned=False)
    assert orders[2][:2] == orders[0][:2]  # the third starts with the first's prefix: the shared blocks lead
    releases = await proxy.metric("cpmemory_hold_releases_total")
    assert releases == {'cpmemory_hold_releases_total{order="planner",reason="slot"}': 1.0}
    assert (await proxy.metric("cpmemory_hold_held_total")) == {"cpmemory_hold_held_total": len(WINDOW)}
    assert proxy.hold.admitted == 0 and proxy.hold.waiting == 0


async def test_the_proxy_sends_in_whatever_order_the_planner_gives(held_proxy):
    proxy = held_proxy(ReversingMemory())
    futures = await hold_window(proxy, WINDOW)
    proxy.transport.gate.set()
    responses = await asyncio.gather(*futures)
    assert all(response.status_code == 200 for response in responses)
    assert proxy.sent_conversations() == ["first"] + [f"w{number}" for number in reversed(range(len(WINDOW)))]
    for (_, sent), ids in zip(proxy.fleet.calls[1:], list(reversed(WINDOW))):
        assert check_no_loss(blocks(ids), sent["messages"]).ok


async def test_streams_and_plain_requests_are_held_and_give_their_slot_back(held_proxy):
    proxy = held_proxy()
    futures = await hold_window(proxy, WINDOW[:2], stream=True)
    plain = proxy.post({"model": "tiny", "messages": [{"role": "user", "content": "Question of plain?"}]})
    await proxy.until(lambda: proxy.hold.waiting == 3)
    proxy.transport.gate.set()
    responses = await asyncio.gather(*futures, plain)
    assert all(response.status_code == 200 for response in responses)
    assert "data: [DONE]" in responses[1].text and "data: [DONE]" in responses[2].text
    assert proxy.sent_conversations() == ["first", "w0", "w1", "plain"]
    for (_, sent), ids in zip(proxy.fleet.calls[1:3], WINDOW[:2]):
        assert check_no_loss(blocks(ids), sent["messages"]).ok
    assert proxy.hold.admitted == 0
    assert (await proxy.memory.state("w0")).turns == 1  # the stream's turn was committed at its end


async def test_a_failed_engine_call_after_release_aborts_its_turn_and_frees_its_slot(held_proxy):
    proxy = held_proxy()
    futures = await hold_window(proxy, WINDOW[:3])
    proxy.fleet.engine(0).fail_next(count=1, status=500)  # "first" reaches the engine first and fails
    proxy.transport.gate.set()
    responses = await asyncio.gather(*futures)
    assert [response.status_code for response in responses] == [502, 200, 200, 200]
    assert (await proxy.memory.state("first")).turns == 0  # aborted: nothing recorded
    assert proxy.memory.counters.snapshot()["aborts"] >= 1
    assert proxy.hold.admitted == 0
    retry = await proxy.client.post("/v1/chat/completions", json=body("first", FIRST))
    assert retry.status_code == 200 and retry.json()["cpmemory"]["turn"] == 1


async def test_a_request_whose_hold_expires_is_released_without_a_slot(held_proxy):
    proxy = held_proxy(hold_ms=20)
    clock = proxy.hold._clock = ManualClock()  # the queue's time, stepped here
    first = proxy.post(body("first", FIRST))
    await asyncio.wait_for(proxy.transport.entered.wait(), 10)
    waiting = proxy.post(body("w0", WINDOW[0]))
    await proxy.until(lambda: proxy.hold.waiting == 1)
    clock.advance(0.02)
    late = await asyncio.wait_for(waiting, 10)
    assert late.status_code == 200  # the first still runs: the hold expired and the request went anyway
    assert proxy.sent_conversations() == ["w0"]
    proxy.transport.gate.set()
    assert (await first).status_code == 200
    assert (await proxy.metric("cpmemory_hold_releases_total")) == {
        'cpmemory_hold_releases_total{order="fcfs",reason="timeout"}': 1.0}
    assert proxy.hold.admitted == 0


async def raw_request(app: Any, payload: dict[str, Any], disconnect: asyncio.Event) -> list[dict[str, Any]]:
    """One ASGI request whose client disconnects when ``disconnect`` is set; returns the messages sent back."""
    data = json.dumps(payload).encode()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"proxy")],
             "client": ("127.0.0.1", 5000), "server": ("proxy", 80)}
    await app(scope, receive, send)
    return sent


async def test_a_client_that_disconnects_while_held_leaves_the_queue_cleanly(held_proxy):
    proxy = held_proxy()
    futures = await hold_window(proxy, WINDOW[:1])
    disconnect = asyncio.Event()
    gone = asyncio.ensure_future(raw_request(proxy.app, body("gone", WINDOW[1]), disconnect))
    await proxy.until(lambda: proxy.hold.waiting == 2)
    disconnect.set()
    sent = await asyncio.wait_for(gone, 10)
    assert sent[0]["status"] == 499 and proxy.hold.waiting == 1
    assert (await proxy.metric("cpmemory_hold_cancelled_total")) == {"cpmemory_hold_cancelled_total": 1.0}
    proxy.transport.gate.set()
    responses = await asyncio.gather(*futures)
    assert all(response.status_code == 200 for response in responses)
    assert proxy.sent_conversations() == ["first", "w0"]  # the gone request never reached the engine
    assert (await proxy.memory.state("gone")).turns == 0 and proxy.memory.counters.snapshot()["prepares"] == 2
    assert proxy.hold.admitted == 0 and proxy.hold.waiting == 0


@pytest.mark.parametrize("cache_tokens, held", [(1, True), (1_000_000, False)])
async def test_with_the_token_bound_requests_wait_while_those_in_flight_fill_the_caches(held_proxy, cache_tokens,
                                                                                       held):
    """--hold-fit without --max-in-flight: the first request's estimated tokens fill caches of 1 token (it runs: one
    always does), so the window waits for it and goes as one planned window; caches of a million hold nothing."""
    proxy = held_proxy(max_in_flight=None, hold_fit=True, replica_cache_tokens=cache_tokens)
    assert proxy.hold.max_in_flight is None
    first = proxy.post(body("first", FIRST))
    await asyncio.wait_for(proxy.transport.entered.wait(), 10)
    assert proxy.hold.tokens > 0  # the first's estimate, counted in flight
    assert (await proxy.metric("cpmemory_hold_tokens")) == {"cpmemory_hold_tokens": proxy.hold.tokens}
    futures = [proxy.post(body(f"w{number}", ids)) for number, ids in enumerate(WINDOW)]
    if held:
        await proxy.until(lambda: proxy.hold.waiting == len(WINDOW))
        assert len(proxy.fleet.calls) == 0
    else:
        await proxy.until(lambda: len(proxy.fleet.calls) == len(WINDOW))  # all sent while the first still runs
        assert proxy.hold.waiting == 0
    proxy.transport.gate.set()
    responses = await asyncio.gather(first, *futures)
    assert [response.status_code for response in responses] == [200] * len(responses)
    by_conversation = {conversation: call for conversation, (_, call) in zip(proxy.sent_conversations(),
                                                                             proxy.fleet.calls)}
    for conversation, ids in [("first", FIRST), *((f"w{n}", ids) for n, ids in enumerate(WINDOW))]:
        assert check_no_loss(blocks(ids), by_conversation[conversation]["messages"]).ok
    held_total = (await proxy.metric("cpmemory_hold_held_total"))["cpmemory_hold_held_total"]
    assert held_total == (len(WINDOW) if held else 0)
    assert proxy.hold.admitted == 0 and proxy.hold.tokens == 0


LONG = {i: f"Memory {i}: " + f"a long remembered fact, number {i}. " * 40 for i in range(5)}  # ~1,500 characters


def long_body(conversation: str, i: int) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": f"Question of {conversation}?"}],
            "cpmemory": {"conversation_id": conversation, "blocks": [{"id": f"mem-{i}", "text": LONG[i]}]}}


@pytest.mark.parametrize("tokenizes", [True, False])
async def test_a_fresh_proxy_counts_its_first_request_to_estimate_tokens_before_any_answer(held_proxy, tokenizes):
    """--hold-fit on a fresh proxy: no answer has taught the estimate yet. The first long request is counted once
    (the engine's /tokenize: the mock counts a token a byte, four times the default estimate), so the next ones,
    about 1,500 tokens each, wait behind it in a cache of 2,000 tokens. By the default (about 380 each) all five
    would run at once; that is what happens when the count fails: reported, nothing lost, and the answers move the
    estimate from then on."""
    proxy = held_proxy(max_in_flight=None, hold_fit=True, replica_cache_tokens=2_000)
    if not tokenizes:
        proxy.fleet.engine(0)._tokenize = lambda request: httpx.Response(404, json={"error": {"message": "no"}})
    fit = proxy.app.state.service.fit
    assert not fit.calibrated
    first = proxy.post(long_body("first", 0))
    await asyncio.wait_for(proxy.transport.entered.wait(), 10)
    assert fit.calibrated is tokenizes
    futures = [proxy.post(long_body(f"w{i}", i)) for i in range(1, 5)]
    if tokenizes:
        assert fit.tokens_per_char == pytest.approx(1.0, abs=0.05)
        await proxy.until(lambda: proxy.hold.waiting == 4)
        assert len(proxy.fleet.calls) == 0
    else:
        await proxy.until(lambda: len(proxy.fleet.calls) == 4)  # all sent while the first still runs
        assert proxy.hold.waiting == 0
        assert (await proxy.metric("cpmemory_fallbacks_total"))['cpmemory_fallbacks_total{kind="calibrate"}'] == 1
    proxy.transport.gate.set()
    responses = await asyncio.gather(first, *futures)
    assert [response.status_code for response in responses] == [200] * 5
    for conversation, (_, call) in zip(proxy.sent_conversations(), proxy.fleet.calls):
        i = 0 if conversation == "first" else int(conversation[1:])
        assert check_no_loss(blocks_of(i), call["messages"]).ok
    assert fit.calibrated is tokenizes and fit.tokens_per_char > 0.3  # else the answers' usage moved it


async def test_without_the_token_bound_nothing_is_counted_before_the_answers(held_proxy):
    """Only --hold-fit decides on the estimate before any answer; without it the answers alone move it."""
    proxy = held_proxy(replica_cache_tokens=2_000)  # the count bound of 1, no token bound
    proxy.transport.gate.set()
    response = await proxy.client.post("/v1/chat/completions", json=long_body("only", 0))
    assert response.status_code == 200
    fit = proxy.app.state.service.fit
    assert not fit.calibrated and 0.25 < fit.tokens_per_char < 1.0


def blocks_of(i: int) -> list[dict[str, str]]:
    return [{"id": f"mem-{i}", "text": LONG[i]}]


async def test_off_by_default_nothing_waits():
    config = ServerConfig(engines=["http://engine-0"])
    assert config.hold.policy == "off" and config.hold.settings() is None
    assert create_app(config).state.service.hold is None
    with pytest.raises(ValueError):
        ServerConfig(engines=["http://engine-0"], hold=HoldConfig(policy="window", max_in_flight=0))
    with pytest.raises(ValueError):
        ServerConfig(engines=["http://engine-0"], hold=HoldConfig(policy="window", timeout_ms=0))
    with pytest.raises(ValueError, match="hold policy"):  # a bound without a policy is a mistake, not ignored
        ServerConfig(engines=["http://engine-0"], hold=HoldConfig(max_in_flight=2))
    # seconds of hold, for a fleet under sustained overload, up to a minute
    long_hold = ServerConfig(engines=["http://engine-0"], hold=HoldConfig(policy="window", timeout_ms=60_000))
    assert long_hold.hold.settings().timeout_s == 60.0
    with pytest.raises(ValueError):
        HoldConfig(policy="window", timeout_ms=60_001)


def test_each_policy_has_its_defaults_and_the_section_overrides_them():
    window = HoldConfig(policy="window").settings()
    assert window.max_in_flight is None and window.token_bound and window.timeout_s == pytest.approx(0.1)
    pick = HoldConfig(policy="pick").settings()
    assert pick.max_in_flight == 1 and not pick.token_bound and pick.timeout_s == pytest.approx(60.0)
    mixed = HoldConfig(policy="pick", max_in_flight=3, timeout_ms=500).settings()
    assert mixed.max_in_flight == 3 and mixed.timeout_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="bound"):
        ServerConfig(engines=["http://a"], hold=HoldConfig(policy="window", token_bound=False))


def test_serve_flags_reach_the_queue(monkeypatch, tmp_path):
    import uvicorn
    from typer.testing import CliRunner

    from cpmemory.cli import app as cli

    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.append(app))
    runner = CliRunner()
    engine = ["serve", "--engine", "http://127.0.0.1:9"]
    result = runner.invoke(cli, [*engine, "--hold", "window"])
    assert result.exit_code == 0, result.output
    hold = served[0].state.service.hold
    assert hold.max_in_flight is None and hold.counts_tokens and hold.hold_s == pytest.approx(0.1)
    assert runner.invoke(cli, engine).exit_code == 0
    assert served[1].state.service.hold is None
    assert runner.invoke(cli, [*engine, "--hold", "pick"]).exit_code == 0
    assert served[2].state.service.hold.max_in_flight == 1 and served[2].state.service.hold.picks
    settings = tmp_path / "serve.toml"
    settings.write_text('[hold]\npolicy = "pick"\nmax_in_flight = 8\ntimeout_ms = 3\n')
    assert runner.invoke(cli, [*engine, "--config", str(settings), "--hold", "window"]).exit_code == 0
    hold = served[3].state.service.hold  # the flag overrides the file's policy; the file's bounds stay
    assert not hold.picks and hold.max_in_flight == 8 and hold.hold_s == pytest.approx(0.003)
    for bad in (["--hold", "sometimes"], ["--upstream", "http://gw", "--hold", "pick"]):
        result = runner.invoke(cli, [*engine, *bad])
        assert result.exit_code == 2 and len(served) == 4


def _cluster_window():
    """Two clusters arriving in turn (each request: its cluster's three shared blocks, then one of its own)."""
    window = []
    for number in range(6):
        for cluster in "ab":
            window.append([Block(f"{cluster}{s}", f"{cluster} shared {s} " + "word " * 40) for s in range(3)]
                          + [Block(f"{cluster}-own{number}", f"{cluster} own {number} " + "word " * 40)])
    return window


def test_the_hold_planner_is_told_the_fleet_cache_and_plans_a_window_that_outgrows_it_as_a_batch():
    from cpmemory.server.admission import fleet_cache_tokens
    from cpmemory.server.fit import CacheFit

    engines = ["http://engine-0", "http://engine-1"]
    window = _cluster_window()  # about 12 x 220 characters, 660 tokens at 4 characters a token
    small = create_app(ServerConfig(engines=engines, replica_cache_tokens=100, **admission()), memory=AsyncCpMemory())
    unknown = create_app(ServerConfig(engines=engines, **admission()), memory=AsyncCpMemory())
    assert fleet_cache_tokens(ServerConfig(engines=engines, replica_cache_tokens=100), None) == 200
    assert fleet_cache_tokens(ServerConfig(engines=engines), None) is None  # the default size is not a reading
    assert fleet_cache_tokens(ServerConfig(engines=engines), CacheFit([300, 500])) == 800  # read from the engines
    assert fleet_cache_tokens(ServerConfig(engines=engines), CacheFit([300, None])) is None
    plan = small.state.service.hold._planner(window, "default")
    assert sorted(plan.order) == list(range(12))
    # split over the two replicas: each cluster (its shared prefix) on one lane, the lanes dealt out in turn
    lane_of = {window[position][0].id[0]: set() for position in range(12)}
    for position, lane in enumerate(plan.lanes):
        lane_of[window[position][0].id[0]].add(lane)
    assert sorted(lane_of.values(), key=str) == [{0}, {1}]
    assert [plan.lanes[position] for position in plan.order] == [0, 1] * 6
    plain = unknown.state.service.hold._planner(window, "default")
    assert list(plain.order) == list(range(12)) and set(plain.lanes) == {None}  # arrival order, not split
    gateway = create_app(ServerConfig(upstream="http://gateway", replica_cache_tokens=100, **admission()),
                         memory=AsyncCpMemory())  # the gateway places: planned, never split
    assert sorted(gateway.state.service.hold._planner(window, "default")) == list(range(12))


CLUSTERS = {cluster: [Block(f"{cluster}{s}", f"{cluster} shared {s} " + "word " * 60) for s in range(3)]
            for cluster in "ab"}


def cluster_body(name: str, cluster: str, number: int) -> dict[str, Any]:
    own = Block(f"{name}-own", f"{name} own {number} " + "word " * 20)
    listed = [{"id": block.id, "text": block.text} for block in [*CLUSTERS[cluster], own]]
    return {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": f"Question of {name}?"}],
            "cpmemory": {"conversation_id": name, "blocks": listed}}


@pytest.mark.parametrize("split", [True, False])
async def test_a_window_that_outgrows_the_caches_is_split_one_prefix_group_a_replica(held_proxy, split):
    proxy = held_proxy(replicas=2, replica_cache_tokens=150, hold_split=split, fit=False)
    proxy.transport.gated = 2  # both slots (one a replica) stay busy until the window is held
    busy = [proxy.post(cluster_body(f"busy{n}", "ab"[n], 99)) for n in range(2)]
    await proxy.until(lambda: proxy.transport.calls == 2)
    names = [(f"{cluster}{n}", cluster, n) for n in range(4) for cluster in "ab"]  # the clusters arrive mixed
    held = []
    for count, (name, cluster, n) in enumerate(names, 1):
        held.append(proxy.post(cluster_body(name, cluster, n)))
        await proxy.until(lambda count=count: proxy.hold.waiting == count)
    proxy.transport.gate.set()
    responses = await asyncio.gather(*busy, *held)
    assert [response.status_code for response in responses] == [200] * len(responses)
    infos = {response.json()["cpmemory"]["conversation_id"]: response.json()["cpmemory"] for response in responses}
    replica = {name: infos[name]["replica"] for name, _, _ in names}
    by_name = {call["messages"][-1]["content"].rsplit("Question of ", 1)[1].rstrip("?"): call
               for _, call in proxy.fleet.calls}
    for name, cluster, n in names:  # every block reached its engine
        body_blocks = cluster_body(name, cluster, n)["cpmemory"]["blocks"]
        assert check_no_loss([Block(b["id"], b["text"]) for b in body_blocks], by_name[name]["messages"]).ok
    if split:
        assert {replica[f"a{n}"] for n in range(4)} != {replica[f"b{n}"] for n in range(4)}
        assert all(len({replica[f"{cluster}{n}"] for n in range(4)}) == 1 for cluster in "ab")
        assert {infos[name]["route_reason"] for name, _, _ in names} == {"lane"}
    else:
        assert "lane" not in {infos[name]["route_reason"] for name, _, _ in names}


async def test_behind_a_gateway_each_lane_of_a_split_window_is_named_as_its_own_session():
    """vllm-router keeps a named session on one replica: the lanes reach it as two sessions, one per prefix group."""
    fleet = MockFleet(1, block_size=16, capacity_blocks=4096)
    transport = GatedTransport(fleet.chat_transport())
    config = ServerConfig(upstream=fleet.urls[0], engines=["http://replica-0", "http://replica-1"],
                          kv_events=["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"], upstream_session=True,
                          cache_salt=False, replica_cache_tokens=150, **admission(fit=False))
    app = create_app(config, memory=AsyncCpMemory(), transport=transport)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=30)
    hold = app.state.service.hold
    try:
        post = lambda payload: asyncio.ensure_future(client.post("/v1/chat/completions", json=payload))  # noqa: E731
        busy = post(cluster_body("busy", "a", 99))
        await asyncio.wait_for(transport.entered.wait(), 10)
        names = [(f"{cluster}{n}", cluster, n) for n in range(4) for cluster in "ab"]
        held = []
        for count, (name, cluster, n) in enumerate(names, 1):
            held.append(post(cluster_body(name, cluster, n)))
            for _ in range(20_000):
                if hold.waiting == count:
                    break
                await asyncio.sleep(0)
        transport.gate.set()
        responses = await asyncio.gather(busy, *held)
        assert [response.status_code for response in responses] == [200] * len(responses)
        session = {call["messages"][-1]["content"].rsplit("Question of ", 1)[1].rstrip("?"):
                   call["session_params"]["session_id"] for _, call in fleet.calls}
        for cluster in "ab":
            assert len({session[f"{cluster}{n}"] for n in range(4)}) == 1
        assert session["a0"] != session["b0"] and session["busy"] not in (session["a0"], session["b0"])
    finally:
        await client.aclose()
        await transport.aclose()


async def test_with_the_pick_each_free_replica_takes_the_held_requests_whose_blocks_it_was_sent(held_proxy):
    proxy = held_proxy(replicas=2, hold_pick=True, fit=False)
    proxy.transport.gated = 2  # both replicas stay busy until the window is held
    busy = []
    for n, cluster in enumerate("ab"):  # busy0 sends cluster a's blocks to one replica, busy1 cluster b's
        busy.append(proxy.post(cluster_body(f"busy{n}", cluster, 99)))
        await proxy.until(lambda n=n: proxy.transport.calls == n + 1)
    names = [(f"{cluster}{n}", cluster, n) for n in range(3) for cluster in "ba"]  # mixed, b first
    held = []
    for count, (name, cluster, n) in enumerate(names, 1):
        held.append(proxy.post(cluster_body(name, cluster, n)))
        await proxy.until(lambda count=count: proxy.hold.waiting == count)
    proxy.transport.gate.set()
    responses = await asyncio.gather(*busy, *held)
    assert [response.status_code for response in responses] == [200] * len(responses)
    infos = {response.json()["cpmemory"]["conversation_id"]: response.json()["cpmemory"] for response in responses}
    assert infos["busy0"]["replica"] != infos["busy1"]["replica"]
    for name, cluster, _ in names:  # each went where its cluster's blocks were sent, picked there
        assert infos[name]["replica"] == infos[f"busy{'ab'.index(cluster)}"]["replica"], name
        assert infos[name]["route_reason"] == "lane"
    by_name = {call["messages"][-1]["content"].rsplit("Question of ", 1)[1].rstrip("?"): call
               for _, call in proxy.fleet.calls}
    for name, cluster, n in names:
        body_blocks = cluster_body(name, cluster, n)["cpmemory"]["blocks"]
        assert check_no_loss([Block(b["id"], b["text"]) for b in body_blocks], by_name[name]["messages"]).ok
    assert proxy.hold.admitted == 0 and proxy.hold.waiting == 0
    held_total = await proxy.metric("cpmemory_hold_held_total")
    assert held_total == {"cpmemory_hold_held_total": len(names)}
    # the view the pick used holds, on busy0's replica, busy0's blocks in the order its prompt showed them
    fleet, texts = proxy.app.state.service.fleet, {b.id: b for b in CLUSTERS["a"]}
    shown = [texts[block_id] for block_id in prompt_order(infos["busy0"]) if block_id in texts]
    assert len(shown) == 3
    chars = sum(len(b.text) + 1 for b in shown)  # held in tokens, at the calibration of when it was sent
    assert fleet.cached_order(infos["busy0"]["replica"], [b.content_hash for b in shown]) == pytest.approx(
        chars * fleet.tokens_per_char())
    assert fleet.cached_order(infos["busy1"]["replica"], [b.content_hash for b in shown]) == 0


def test_the_pick_needs_the_proxy_s_own_replicas_and_a_count():
    with pytest.raises(ValueError, match="pick"):
        ServerConfig(engines=["http://a"], upstream="http://gw", hold=HoldConfig(policy="pick"))
    # a token share alone does not make a replica free: the pick always has its count (unset: the default, one)
    assert ServerConfig(engines=["http://a"], hold=HoldConfig(policy="pick", token_bound=True)).hold.settings().max_in_flight == 1
    assert ServerConfig(engines=["http://a"], hold=HoldConfig(policy="pick", token_bound=True)).hold.policy == "pick"
    assert ServerConfig(engines=["http://a"], hold=HoldConfig(policy="pick", max_in_flight=2)).hold.policy == "pick"


async def test_the_pick_s_view_is_bounded_by_each_replica_s_cache_in_tokens(held_proxy):
    proxy = held_proxy(replicas=2, hold_pick=True, replica_cache_tokens=1_000)
    proxy.transport.gate.set()
    response = await proxy.post(cluster_body("only", "a", 1))
    assert response.status_code == 200
    service = proxy.app.state.service
    assert service.fit is not None and service.fit.capacities[0] is not None
    fleet = service.fleet
    expected = service.fit.capacities[0]
    assert fleet.capacity_tokens(0) == expected
    assert 0 < fleet.order_tokens(response.json()["cpmemory"]["replica"]) <= expected
