"""Cache-fit admission end to end: the real proxy app (real facade, in-memory store) in front of mock engines whose
KV cache size is given (``replica_cache_tokens``). A first turn never waits; a later turn of a conversation whose
history no longer fits beside an older conversation's on its replica waits until that one has been idle for
``fit_idle_ms``; with admission off nothing waits. Streams and plain calls both give their share back, and every block
reaches the engine."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cpmemory.core.invariants import check_no_loss
from cpmemory.server.clock import ManualClock
from cpmemory.server.config import FitConfig

CACHE_TOKENS = 2_000  # per replica; fill 0.9: 1,800 tokens of live histories
IDLE_MS = 400.0


def body(conversation: str, turn: int, stream: bool = False) -> dict[str, Any]:
    text = f"Passage {turn} of {conversation}: " + f"fact about {conversation}, told at length. " * 110  # ~1,200 tokens
    return {"model": "tiny", "max_tokens": 8, "stream": stream,
            "messages": [{"role": "user", "content": f"What about {conversation}, part {turn}?"}],
            "cpmemory": {"conversation_id": conversation,
                         "blocks": [{"id": f"doc-{conversation}-{turn}", "text": text}]}}


async def post(proxy: Any, conversation: str, turn: int, stream: bool = False) -> int:
    """One turn; returns the replica it was sent to."""
    response = await proxy.client.post("/v1/chat/completions", json=body(conversation, turn, stream))
    assert response.status_code == 200
    return int(response.headers["X-Cpmemory-Replica"]) if stream else response.json()["cpmemory"]["replica"]


def stepped(proxy: Any) -> ManualClock:
    """Admission's time, stepped by the test: a wait lasts what the test says, however loaded the machine is."""
    clock = proxy.service.fit._clock = ManualClock()
    return clock


async def held_then_let_in(proxy: Any, clock: ManualClock, turn: Any) -> Any:
    """Run ``turn`` (a coroutine) until admission holds it, check it is held for most of the idle window, then step
    past the window; returns what the turn returns."""
    task = asyncio.ensure_future(turn)

    for _ in range(20_000):  # loop steps, no time: a held turn reaches the queue within a few
        if proxy.service.fit.waiting or task.done():
            break
        await asyncio.sleep(0)
    assert not task.done() and proxy.service.fit.waiting == 1
    clock.advance(0.9 * IDLE_MS / 1000)
    await asyncio.sleep(0)
    assert not task.done()  # still held: the older conversation's idle window is not over
    clock.advance(0.2 * IDLE_MS / 1000)
    return await asyncio.wait_for(task, 10)


async def fit_counts(proxy: Any) -> dict[str, float]:
    text = (await proxy.client.get("/metrics")).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("cpmemory_fit_admissions_total{"):
            counts[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


async def waits(proxy: Any) -> float:
    """Turns that waited for room (the wait histogram's count): a count, so a loaded machine cannot fake a wait."""
    for line in (await proxy.client.get("/metrics")).text.splitlines():
        if line.startswith("cpmemory_fit_wait_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_later_turn_waits_while_an_older_conversation_fills_its_replica(make_proxy, stream: bool) -> None:
    proxy = make_proxy(1, replica_cache_tokens=CACHE_TOKENS, fit=FitConfig(idle_ms=IDLE_MS, first_idle_ms=IDLE_MS))
    clock = stepped(proxy)
    for turn in (1, 2):
        await post(proxy, "a", turn, stream)  # a is live, with two turns: it holds its share for fit_idle_ms
    await post(proxy, "b", 1, stream)
    assert await waits(proxy) == 0  # a first turn never waits
    await held_then_let_in(proxy, clock, post(proxy, "b", 2, stream))  # a's and b's histories do not fit together
    counts = await fit_counts(proxy)
    assert counts["first"] == 2 and counts["live"] == 1 and counts["resumed"] == 1
    assert "cpmemory_fit_wait_seconds_count 1.0" in (await proxy.client.get("/metrics")).text


async def test_a_stream_says_why_admission_let_it_in_and_how_long_it_waited(make_proxy) -> None:
    from cpmemory.server.fit import FIT_HEADER, parse_fit_header

    proxy = make_proxy(1, replica_cache_tokens=CACHE_TOKENS, fit=FitConfig(idle_ms=IDLE_MS, first_idle_ms=IDLE_MS))
    clock = stepped(proxy)
    seen = []
    for conversation, turn in (("a", 1), ("a", 2), ("b", 1), ("b", 2)):
        sent = proxy.client.post("/v1/chat/completions", json=body(conversation, turn, stream=True))
        response = await (held_then_let_in(proxy, clock, sent) if (conversation, turn) == ("b", 2) else sent)
        assert response.status_code == 200
        seen.append(parse_fit_header(response.headers.get(FIT_HEADER)))
    assert [reason for reason, _ in seen] == ["first", "live", "first", "resumed"]
    assert seen[1][1] == 0.0 and seen[3][1] == pytest.approx(IDLE_MS, abs=2.0)  # b waited for a to go idle (ms)
    off = make_proxy(1, replica_cache_tokens=CACHE_TOKENS, fit=FitConfig(enabled=False))
    response = await off.client.post("/v1/chat/completions", json=body("a", 1, stream=True))
    assert response.status_code == 200 and "X-Cpmemory-Fit" not in response.headers


def test_parse_fit_header_reads_only_its_own_form() -> None:
    from cpmemory.server.fit import FitSlot, parse_fit_header

    assert parse_fit_header(FitSlot(None, "c", 0, "moved", 0.01234).header()) == ("moved", 12.3)
    assert parse_fit_header("resumed; wait_ms=812.5") == ("resumed", 812.5)
    assert parse_fit_header("live;wait_ms=0") == ("live", 0.0)
    for bad in (None, "", "live", "live; wait=3", "live; wait_ms=soon"):
        assert parse_fit_header(bad) is None


async def test_turns_that_fit_together_do_not_wait(make_proxy) -> None:
    proxy = make_proxy(1, replica_cache_tokens=10 * CACHE_TOKENS, fit=FitConfig(idle_ms=IDLE_MS, first_idle_ms=IDLE_MS))
    for turn in (1, 2):
        for conversation in ("a", "b"):
            await post(proxy, conversation, turn)
            assert await waits(proxy) == 0
    assert (await fit_counts(proxy)) == {"first": 2, "live": 2}


async def test_with_admission_off_nothing_waits(make_proxy) -> None:
    proxy = make_proxy(1, replica_cache_tokens=CACHE_TOKENS, fit=FitConfig(enabled=False))
    for turn in (1, 2):
        await post(proxy, "a", turn)
    await post(proxy, "b", 1)
    response = await proxy.client.post("/v1/chat/completions", json=body("b", 2))
    assert response.status_code == 200  # admission on would hold b's second turn for a's idle time (IDLE_MS)
    assert await fit_counts(proxy) == {} and await waits(proxy) == 0 and response.json()["cpmemory"]["wait_ms"] == 0


async def test_every_block_reaches_the_engine_while_turns_wait(make_proxy) -> None:
    proxy = make_proxy(1, replica_cache_tokens=CACHE_TOKENS, fit=FitConfig(idle_ms=50.0))
    sent = [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("a", 3)]
    for conversation, turn in sent:
        await post(proxy, conversation, turn)
    requests = proxy.engines[0].requests
    assert len(requests) == len(sent)
    for request, (conversation, turn) in zip(requests, sent):
        blocks = [(block["id"], block["text"]) for block in body(conversation, turn)["cpmemory"]["blocks"]]
        report = check_no_loss(blocks, request["body"]["messages"])
        assert report.ok, report


def test_serve_flags_and_the_config_file_reach_admission(monkeypatch, tmp_path) -> None:
    import uvicorn
    from typer.testing import CliRunner

    from cpmemory.cli import app as cli

    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.append(app))
    runner = CliRunner()
    settings = tmp_path / "serve.toml"
    settings.write_text("replica_cache_tokens = 4096\n[fit]\nmax_wait_s = 7\nidle_ms = 250\nfill = 0.45\n")
    result = runner.invoke(cli, ["serve", "--engine", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:10",
                                 "--config", str(settings)])
    assert result.exit_code == 0, result.output
    fit = served[0].state.service.fit
    assert fit.capacities == [4096, 4096] and fit.max_wait_s == 7 and fit.idle_s == pytest.approx(0.25)
    assert fit.fill == pytest.approx(0.45)
    assert runner.invoke(cli, ["serve", "--engine", "http://127.0.0.1:9", "--no-fit"]).exit_code == 0
    assert served[1].state.service.fit is None
    for bad in ("[fit]\nmax_wait_s = 0\n", "[fit]\nfill = 1.5\n", "[fit]\nfil = 0.5\n"):  # the last: a typo
        settings.write_text(bad)
        result = runner.invoke(cli, ["serve", "--engine", "http://127.0.0.1:9", "--config", str(settings)])
        assert result.exit_code == 2 and len(served) == 2


def test_admission_is_sized_per_replica_or_as_one_pool_behind_a_gateway() -> None:
    from cpmemory.server.admission import build_fit
    from cpmemory.server.app import ServerConfig
    from cpmemory.server.metrics import ProxyMetrics

    engines = ["http://e0", "http://e1"]
    direct = build_fit(ServerConfig(engines=engines, replica_cache_tokens=1000), ProxyMetrics(2))
    assert direct is not None and direct.capacities == [1000, 1000]
    gateway = build_fit(ServerConfig(engines=engines, upstream="http://gw", replica_cache_tokens=1000), ProxyMetrics(1))
    assert gateway is not None and gateway.capacities == [2000]
    unsized = build_fit(ServerConfig(engines=engines), ProxyMetrics(2))
    assert unsized is not None and not unsized.sized  # until the engines' /metrics give the sizes
    assert build_fit(ServerConfig(engines=engines, fit=FitConfig(enabled=False)), ProxyMetrics(2)) is None


async def test_a_conversation_outgrown_on_its_replica_moves_to_the_other_and_stays_there(make_proxy) -> None:
    """Two conversations dealt to one replica (rendezvous affinity); once the older one's history grows past what
    the cache holds beside the younger one's, the younger one's next turn goes at once to the replica with room, and
    its later turns follow it there."""
    from cpmemory.routing.router import Router, RouterConfig, conversation_affinity_key

    proxy = make_proxy(2, replica_cache_tokens=4_000, fit=FitConfig(idle_ms=2_000.0, first_idle_ms=2_000.0),
                       router=RouterConfig(policy="affinity"))
    ranking = Router(proxy.fleet.urls).ranking
    names = [f"conv-{index}" for index in range(64)]
    home = {name: ranking(conversation_affinity_key("default", name))[0] for name in names}
    older = names[0]
    younger = next(name for name in names[1:] if home[name] == home[older])
    first = await post(proxy, older, 1)  # ~1,250 tokens
    second = await post(proxy, younger, 1)
    assert first == second  # both on one replica
    for turn in (2, 3):
        await post(proxy, older, turn)  # the older one grows to ~3,700 tokens: the younger one no longer fits
    moved_to = await post(proxy, younger, 2)
    assert moved_to != first and await waits(proxy) == 0  # moved at once, not after the older one's idle window
    counts = await fit_counts(proxy)
    assert counts["moved"] == 1 and counts.get("resumed", 0) == 0
    then = await post(proxy, younger, 3)
    assert then == moved_to  # it stays where it moved
    last = proxy.engines[moved_to].requests[-1]["body"]["messages"]  # the younger one's third turn
    blocks = [(block["id"], block["text"]) for block in body(younger, 3)["cpmemory"]["blocks"]]
    report = check_no_loss(blocks, last)
    assert report.ok, report
    sent = "\n".join(str(message.get("content")) for message in last)
    assert body(younger, 1)["cpmemory"]["blocks"][0]["text"] in sent  # its history reached the replica it moved to


async def test_a_turn_s_admission_wait_is_reported_apart_from_the_proxy_s_overhead(make_proxy) -> None:
    proxy = make_proxy(1, replica_cache_tokens=CACHE_TOKENS, fit=FitConfig(idle_ms=IDLE_MS, first_idle_ms=IDLE_MS))
    for turn in (1, 2):
        await post(proxy, "a", turn)
    await post(proxy, "b", 1)
    started = time.perf_counter()
    response = await proxy.client.post("/v1/chat/completions", json=body("b", 2))
    latency_ms = (time.perf_counter() - started) * 1000
    info = response.json()["cpmemory"]
    assert await waits(proxy) == 1 and info["wait_ms"] > 0  # b waited for a to go idle, by design
    assert info["overhead_ms"] + info["wait_ms"] <= latency_ms + 1.0  # the wait is not counted twice
