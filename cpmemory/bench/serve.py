"""``cpmemory bench serve``: replay a trace through ``cpmemory serve`` with concurrent streamed clients, on real engines.

Two strategies in one run, the engines' prefix caches emptied before each (``POST /reset_prefix_cache``, vLLM with
``VLLM_SERVER_DEV_MODE=1``):

* ``original``: the same block format, relevance order and full history, sent straight to the engines with
  conversation-affinity routing (the proxy's own router and failover loop), or to ``--upstream``;
* ``cpmemory``: question + blocks through the proxy (started in this process, or ``--proxy URL``), online.

Per strategy: TTFT mean / p50 / p90, mean end-to-end latency, throughput (answered requests/s, prompt tokens/s), the
engines' cached and prompt tokens (usage), errors and lost blocks (``check_no_loss`` on what reached the engine).
How the replay runs (concurrency, Poisson rate, deadlines, failures): :mod:`cpmemory.bench.serve_run`.

Example::

    cpmemory bench serve --workload mt_rag --engine http://127.0.0.1:8000 --engine http://127.0.0.1:8001 --json
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from cpmemory.bench.serve_run import (
    STRATEGIES,
    Outcome,
    ServeSettings,
    StrategyRun,
    check_losses,
    replay,
    request_record,
    select_jobs,
    validate,
)
from cpmemory.bench.trace import Trace
from cpmemory.errors import CpMemoryError
from cpmemory.server.config_file import read_config_file

DEFAULT_REQUESTS = 64
DEFAULT_CONCURRENCY = 8
DEFAULT_MAX_TURNS = 6
DEFAULT_CALIBRATE_REQUESTS = 48


ABLATIONS: dict[str, dict[str, Any]] = {
    "cpmemory-nofit": {"fit": {"enabled": False}},
    "cpmemory-nomove": {"experimental": {"fit_move": False}},
    "cpmemory-nosplit": {"experimental": {"hold_split": False}},
    "cpmemory-nohold": {"hold": {"policy": "off", "max_in_flight": None, "token_bound": None, "timeout_ms": None}},
}
"""What each ablation strategy changes in the in-process proxy's configuration (``cpmemory-nopick``: see
:func:`proxy_config`)."""


def proxy_config(settings: ServeSettings, cache_tokens: int | None = None, ablation: str | None = None) -> Any:
    """The in-process proxy's :class:`~cpmemory.server.config.ServerConfig`: ``settings.proxy_config`` (a
    ``--config`` file's tree) with the run's engines, gateway, KV events, tokenizer and ``--hold`` over it, then the
    ``ablation`` strategy's change. Without KV events the router's view of what each replica caches assumes
    ``cache_tokens`` per replica (the engines' own KV cache size when known). Every cross-field rule is the
    config's own (pydantic's ValidationError)."""
    from cpmemory.server.config import ServerConfig
    from cpmemory.server.config_file import merge

    given: dict[str, Any] = {"engines": list(settings.engines), "upstream": settings.upstream,
                             "kv_events": list(settings.kv_events), "engine_timeout_s": settings.engine_timeout_s}
    if settings.tokenizer is not None:
        given["tokenizer"] = settings.tokenizer
    if settings.upstream_kind is not None:
        given["upstream_kind"] = settings.upstream_kind
    if settings.hold is not None:
        given["hold"] = {"policy": settings.hold}
    if cache_tokens:
        given["replica_cache_tokens"] = cache_tokens
    tree = merge(settings.proxy_config, given)
    if ablation == "cpmemory-nopick":  # whole windows with the pick's own bounds
        picked = ServerConfig.model_validate(tree).hold.settings()
        if picked is not None:
            tree = merge(tree, {"hold": {"policy": "window", "max_in_flight": picked.max_in_flight,
                                         "token_bound": picked.token_bound, "timeout_ms": picked.timeout_s * 1000}})
    elif ablation in ABLATIONS:
        tree = merge(tree, ABLATIONS[ablation])
    return ServerConfig.model_validate(tree)


@contextlib.asynccontextmanager
async def in_process_proxy(settings: ServeSettings, cache_tokens: int | None = None,
                           ablation: str | None = None) -> AsyncIterator[tuple[str, Any]]:
    """Serve a ``cpmemory serve`` app (:func:`proxy_config`) on a free loopback port in this event loop; yields
    (URL, recording transport)."""
    import uvicorn

    from cpmemory.bench.load import RecordingTransport, _free_port
    from cpmemory.routing.transport import HttpxChatTransport
    from cpmemory.server.app import create_app

    recording = RecordingTransport(HttpxChatTransport())
    config = proxy_config(settings, cache_tokens, ablation)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config, transport=recording), host="127.0.0.1", port=port,
                                           log_level="error", lifespan="on", timeout_keep_alive=600))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if serving.done():
                serving.result()
                raise CpMemoryError("the in-process proxy stopped during start-up")
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}", recording
    finally:
        server.should_exit = True
        await serving
        await recording.aclose()


@contextlib.asynccontextmanager
async def strategy_client(name: str, settings: ServeSettings, system_prompt: str,
                          cache_tokens: int | None = None) -> AsyncIterator[Any]:
    """The client of one strategy (see :mod:`cpmemory.bench.serve_clients`), closed on exit."""
    from cpmemory.bench.serve_clients import DirectClient, ProxyClient

    if name in ("original", "original-priority"):
        urls = [settings.upstream] if settings.upstream else list(settings.engines)
        client: Any = DirectClient(urls, model=settings.model, max_tokens=settings.max_tokens,
                                   timeout_s=settings.engine_timeout_s, system_prompt=system_prompt,
                                   failover=settings.upstream is None,
                                   name_sessions=settings.upstream_session and settings.upstream is not None,
                                   policy="session" if settings.original_routing == "session" else "affinity",
                                   priority=name == "original-priority")
        try:
            yield client
        finally:
            await client.aclose()
        return
    if settings.proxy is not None:
        client = ProxyClient(settings.proxy, model=settings.model, max_tokens=settings.max_tokens,
                             timeout_s=settings.timeout_s)
        try:
            yield client
        finally:
            await client.aclose()
        return
    async with in_process_proxy(settings, cache_tokens, name if name != "cpmemory" else None) as (url, recording):
        client = ProxyClient(url, model=settings.model, max_tokens=settings.max_tokens,
                             timeout_s=settings.timeout_s, recording=recording)
        try:
            yield client
        finally:
            await client.aclose()


async def engine_facts(settings: ServeSettings) -> list[dict[str, Any]]:
    """Each engine's KV cache (tokens, from ``/metrics``) after one untimed warm-up request, all engines at once,
    each call bounded by the engine timeout. Never raises."""
    from cpmemory.engines.client import AsyncEngineClient, EngineSettings
    from cpmemory.errors import EngineError

    async def one(url: str) -> dict[str, Any]:
        row: dict[str, Any] = {"url": url, "kv_cache_tokens": None, "block_size": None}
        engine = EngineSettings(base_url=url, model=settings.model, timeout_s=settings.engine_timeout_s)
        try:
            async with AsyncEngineClient(engine) as client:
                await client.chat([{"role": "user", "content": "warm up"}], max_tokens=1, stream=True)
                config = await client.cache_config()
                row["block_size"] = config.block_size
                row["kv_cache_tokens"] = config.num_blocks * config.block_size if config.num_blocks else None
        except EngineError as error:
            row["error"] = str(error)[:200]
        return row

    return list(await asyncio.gather(*(one(url) for url in settings.engines)))


async def run_serve(trace: Trace, settings: ServeSettings,
                    progress: Callable[[str, Outcome], None] | None = None) -> dict[str, Any]:
    """Replay ``trace`` through every strategy of ``settings``; return the report (see :func:`report_json`)."""
    from cpmemory.bench.serve_clients import ProxyClient, reset_prefix_caches
    from cpmemory.bench.serve_metrics import ENGINE_SAMPLES, PROXY_SAMPLES, delta, scrape
    from cpmemory.session.config import DEFAULT_SYSTEM_PROMPT

    validate(settings)
    engines = await engine_facts(settings)
    known = [row["kv_cache_tokens"] for row in engines if row.get("kv_cache_tokens")]
    cache_tokens = min(known) if known else None
    runs = {name: StrategyRun(name) for name in settings.strategies}
    sessions: list[Any] = []
    for round_number in range(settings.rounds):
        # one run id per round, shared by the strategies (same conversations, so the original's rendezvous routing
        # is the same in every strategy); odd rounds run the strategies in reverse (ABBA: a drift in the machine's
        # load weighs on both alike)
        sessions = select_jobs(trace, settings, uuid.uuid4().hex[:8])
        order = settings.strategies if round_number % 2 == 0 else settings.strategies[::-1]
        for name in order:
            run = StrategyRun(name, reset=await reset_prefix_caches(settings.engines, settings.engine_timeout_s))
            before = os.getloadavg()[0]
            engines_before = await scrape(settings.engines, ENGINE_SAMPLES)
            async with strategy_client(name, settings, DEFAULT_SYSTEM_PROMPT, cache_tokens) as client:
                proxy = [client.base_url] if isinstance(client, ProxyClient) else []
                proxy_before = await scrape(proxy, PROXY_SAMPLES) if proxy else None
                advance = (lambda outcome, name=name: progress(name, outcome)) if progress else None
                run.outcomes, run.wall_s = await replay(client, sessions, trace.multi_turn, settings, advance)
                run.proxy_raw = delta(proxy_before, await scrape(proxy, PROXY_SAMPLES)) if proxy else None
                run.failover_samples = list(getattr(client, "failures", []))
            run.engine_raw = delta(engines_before, await scrape(settings.engines, ENGINE_SAMPLES))
            run.load_average = [(before, os.getloadavg()[0])]  # 1-minute load at start and end of the replay
            check_losses(run)
            runs[name].merge(run)
    return report_json(trace, settings, runs, engines, len(sessions))


async def measure_capacity(trace: Trace, settings: ServeSettings, requests: int,
                           progress: Callable[[str, Outcome], None] | None = None) -> dict[str, Any]:
    """What the engines serve of this trace, straight and in the original order: ``original`` alone, closed loop
    with ``settings.concurrency`` clients over the first ``requests`` requests, caches reset; its answered requests
    per second is the capacity that ``--load`` fractions refer to. Raises CpMemoryError when nothing was answered."""
    calibration = settings.model_copy(update={"strategies": ("original",), "rate": None, "rounds": 1,
                                              "requests": min(requests, settings.requests)})
    figures = (await run_serve(trace, calibration, progress))["strategies"]["original"]
    if not figures["throughput_rps"]:
        raise CpMemoryError(f"the capacity run answered no request ({figures['errors']} errors): no rate for --load")
    return {"throughput_rps": figures["throughput_rps"], "concurrency": settings.concurrency,
            "requests": calibration.requests, "errors": figures["errors"], "ttft_mean_ms": figures["ttft_mean_ms"]}


def load_rates(loads: list[float], capacity_rps: float) -> list[tuple[float, float]]:
    """(load, Poisson rate) per ``--load`` fraction, ascending; each rate rounded to 1/1000 per second."""
    return [(one, max(round(one * capacity_rps, 3), 0.001)) for one in sorted(loads)]


def report_json(trace: Trace, settings: ServeSettings, runs: dict[str, StrategyRun], engines: list[dict[str, Any]],
                sessions: int) -> dict[str, Any]:
    """The ``--json`` object: ``strategies`` (exact figures), ``ttft_mean_speedup``, and what the run was."""
    strategies = {name: run.figures() for name, run in runs.items()}
    speedup = None
    original, ours = strategies.get("original"), strategies.get("cpmemory")
    if original and ours and original["ttft_mean_ms"] and ours["ttft_mean_ms"]:
        speedup = round(original["ttft_mean_ms"] / ours["ttft_mean_ms"], 3)
    throughput = None
    if original and ours and original["throughput_rps"]:
        throughput = round(ours["throughput_rps"] / original["throughput_rps"], 3)
    details = {name: run.details() for name, run in runs.items()}
    return {
        "strategies": strategies, "ttft_mean_speedup": speedup, "throughput_speedup": throughput,
        "engine_ttft_mean_speedup": _engine_ttft_speedup(details),
        "workload": trace.name, "multi_turn": trace.multi_turn, "sessions": sessions,
        "settings": settings.model_dump(mode="json"), "engines": engines,
        "details": {name: {**details[name], **({"by_turn": run.by_turn()} if trace.multi_turn else {})}
                    for name, run in runs.items()},
    }


def _engine_ttft_speedup(details: dict[str, dict[str, Any]]) -> float | None:
    """original / cpmemory of vLLM's own mean TTFT (``vllm:time_to_first_token_seconds``: from the request's
    arrival at the engine, so without the proxy's hop and cache-fit admission's waits); None when not scraped."""
    def engine_ttft(name: str) -> float | None:
        engine = (details.get(name) or {}).get("engine") or {}
        return engine.get("ttft_mean_ms") or None

    original, ours = engine_ttft("original"), engine_ttft("cpmemory")
    return round(original / ours, 3) if original and ours else None


# ---------------------------------------------------------------- report

def print_table(report: dict[str, Any], console: Any) -> None:
    """The side-by-side table of one run."""
    from rich.table import Table

    settings = report["settings"]
    load = f"rate {settings['rate']}/s" if settings.get("rate") else f"concurrency {settings['concurrency']}"
    if "load" in report:
        load = f"load {report['load']:g} of {report['capacity']['throughput_rps']:.3f} req/s, {load}"
    table = Table(title=f"bench serve {report['workload']}: {report['sessions']} sessions, {load}, "
                        f"{len(settings['engines'])} engine(s)" + (" via upstream" if settings.get("upstream") else ""))
    for header in ("strategy", "TTFT mean ms", "p50", "p90", "latency mean ms", "req/s", "prompt tok/s",
                   "cached / prompt tokens", "errors", "lost"):
        table.add_column(header, justify="left" if header == "strategy" else "right")
    for name, s in report["strategies"].items():
        cached = f"{s['cached_tokens']:,} / {s['prompt_tokens']:,}"
        table.add_row(name, _ms(s["ttft_mean_ms"]), _ms(s["ttft_p50_ms"]), _ms(s["ttft_p90_ms"]),
                      _ms(s["latency_mean_ms"]), f"{s['throughput_rps']:.3f}", f"{s['prompt_tokens_per_s']:,.0f}",
                      cached, str(s["errors"]), str(s["lost_blocks"]), style="bold" if name == "cpmemory" else None)
    kv = ", ".join(f"{e['kv_cache_tokens']:,}" if e.get("kv_cache_tokens") else "?" for e in report["engines"])
    sets = ", ".join(f"{n} {d['working_set_tokens']:,} (peak {d['peak_working_set_tokens']:,})"
                     for n, d in report["details"].items())
    engine = f" (vLLM's own TTFT x{report['engine_ttft_mean_speedup']})" if report.get("engine_ttft_mean_speedup") else ""
    table.caption = (f"TTFT mean speed-up x{report['ttft_mean_speedup']}{engine}, "
                     f"throughput x{report['throughput_speedup']}; "
                     f"KV cache per engine {kv} tokens; working set (tokens) {sets}")
    console.print(table)
    for name, details in report["details"].items():
        for sample in details["error_samples"]:
            console.print(f"[yellow]{name} error:[/] {sample}", soft_wrap=True)
        for sample in details["loss_samples"]:
            console.print(f"[red]{name} lost:[/] {sample}", soft_wrap=True)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def sweep_rows(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per rate of a sweep: the rate, both speed-ups and each strategy's exact figures."""
    return [{"rate": one["settings"]["rate"], **({"load": one["load"]} if "load" in one else {}),
             "ttft_mean_speedup": one["ttft_mean_speedup"],
             "engine_ttft_mean_speedup": one.get("engine_ttft_mean_speedup"),
             "throughput_speedup": one["throughput_speedup"], "strategies": one["strategies"]} for one in reports]


def print_sweep(report: dict[str, Any], console: Any) -> None:
    """TTFT mean / p90 per strategy at each rate of a sweep, and the mean speed-up."""
    from rich.table import Table

    names = list(report["strategies"])
    table = Table(title=f"bench serve {report['workload']}: TTFT by arrival rate")
    loaded = "load" in report["sweep"][0]
    if loaded:
        table.add_column("load", justify="right")
    table.add_column("rate /s", justify="right")
    for name in names:
        table.add_column(f"{name} TTFT mean / p90 ms", justify="right")
        table.add_column(f"{name} req/s", justify="right")
    table.add_column("TTFT mean speed-up", justify="right")
    for row in report["sweep"]:
        cells = ([f"{row['load']:g}"] if loaded else []) + [f"{row['rate']:g}"]
        for name in names:
            s = row["strategies"][name]
            cells += [f"{_ms(s['ttft_mean_ms'])} / {_ms(s['ttft_p90_ms'])}", f"{s['throughput_rps']:.3f}"]
        table.add_row(*cells, f"x{row['ttft_mean_speedup']}")
    console.print(table)


def plot_sweep(report: dict[str, Any], path: Path) -> None:
    """Write TTFT mean (solid) and p90 (dashed) against the arrival rate, per strategy, as a PNG."""
    from cpmemory.bench.report import _pyplot

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    rates = [row["rate"] for row in report["sweep"]]
    for number, name in enumerate(report["strategies"]):
        for key, style in (("ttft_mean_ms", "-"), ("ttft_p90_ms", "--")):
            values = [(row["strategies"][name][key] or float("nan")) / 1000.0 for row in report["sweep"]]
            axis.plot(rates, values, style, color=f"C{number}", marker="o", label=f"{name} {key.split('_')[1]}",
                      linewidth=2.4 if name == "cpmemory" else 1.4)
    axis.set(xlabel="arrival rate (requests/s, Poisson)", ylabel="time to first token (s)",
             title=f"{report['workload']}: TTFT by arrival rate")
    _save(plt, figure, axis, path)


def plot_cdf(report: dict[str, Any], runs_ttft: dict[str, list[float]], path: Path) -> None:
    """Write the TTFT CDF per strategy as a PNG."""
    import numpy as np

    from cpmemory.bench.report import _pyplot

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, values in runs_ttft.items():
        if values:
            ordered = np.sort(np.asarray(values) / 1000.0)
            axis.step(ordered, np.arange(1, len(ordered) + 1) / len(ordered), where="post", label=name,
                      linewidth=2.4 if name == "cpmemory" else 1.4)
    axis.set(xlabel="time to first token (s)", ylabel="fraction of requests",
             title=f"{report['workload']}: TTFT CDF (mean speed-up x{report['ttft_mean_speedup']})")
    _save(plt, figure, axis, path)


def _save(plt: Any, figure: Any, axis: Any, path: Path) -> None:
    """Grid, legend, layout; write the PNG (its folder made) and close the figure."""
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _load(trace_file: Path | None, workload: str | None, data_dir: Path | None, multi_turn: bool | None) -> Trace:
    from cpmemory.bench.prompts import load_trace

    return load_trace(trace_file, workload, data_dir, False, multi_turn)


def command(
    engine: Annotated[list[str], typer.Option("--engine", help="Engine base URL (repeat per replica).")],
    trace_file: Path | None = typer.Option(None, "--trace", help="A JSON Lines trace (see docs/results/replay.md)."),
    workload: str | None = typer.Option(None, "--workload", help="mt_rag | locomo_sessions | synthetic_long | ..."),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Data folder (default ../shared/data)."),
    upstream: str | None = typer.Option(None, "--upstream", help="A router in front of the engines (both strategies)."),
    proxy: str | None = typer.Option(None, "--proxy", help="Use a running cpmemory proxy instead of starting one."),
    kv_events: Annotated[list[str] | None, typer.Option("--kv-events", help="KV-event endpoint per --engine.")] = None,
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="The proxy's local tokenizer (serve --tokenizer)."),
    config_file: Path | None = typer.Option(
        None, "--config", help="The in-process proxy's settings: a TOML or YAML file of cpmemory serve --config."),
    hold: str | None = typer.Option(None, "--hold", help="The in-process proxy's hold: off, window or pick "
                                    "(cpmemory serve --hold)."),
    upstream_kind: str | None = typer.Option(None, "--upstream-kind", help="The in-process proxy's gateway kind "
                                             "(cpmemory serve --upstream-kind)."),
    upstream_session: bool = typer.Option(
        False, "--upstream-session", help="The original strategy names each conversation to --upstream "
        "(session_params), as --upstream-kind vllm-router has the proxy do."),
    original_routing: str = typer.Option(
        "session", "--original-routing",
        help="original's conversation affinity: session (first turn to the least loaded replica, then sticky) or "
             "hash (rendezvous hash of the conversation id)."),
    concurrency: int = typer.Option(DEFAULT_CONCURRENCY, "--concurrency", min=1, help="Concurrent clients."),
    rate: Annotated[list[float] | None, typer.Option(
        "--rate", min=0.001, help="Poisson arrivals per second instead (repeat for a sweep: one run per rate).")] = None,
    load: Annotated[list[float] | None, typer.Option(
        "--load", min=0.01, max=4.0,
        help="Poisson arrivals at this fraction of the original's measured capacity (repeat for a sweep).")] = None,
    calibrate_requests: int = typer.Option(
        DEFAULT_CALIBRATE_REQUESTS, "--calibrate-requests", min=1,
        help="Requests of the closed-loop original run that measures the capacity for --load."),
    requests: int = typer.Option(DEFAULT_REQUESTS, "--requests", min=1, help="Requests per strategy."),
    max_turns: int = typer.Option(DEFAULT_MAX_TURNS, "--max-turns", min=1, help="Turns kept per session."),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1, help="Tokens generated per request."),
    timeout: float = typer.Option(300.0, "--timeout", min=0.1, help="Deadline of one request (s)."),
    engine_timeout: float = typer.Option(120.0, "--engine-timeout", min=0.1, help="Per-call engine timeout (s)."),
    strategies: str = typer.Option(",".join(STRATEGIES), "--strategies", help="Comma-separated, in run order (original, cpmemory, cpmemory-nofit: the proxy without cache-fit admission, cpmemory-nomove: without its moves; cpmemory-nosplit: the hold queue without its split over replicas; cpmemory-nohold: the proxy without the hold queue of --hold; cpmemory-nopick: whole windows with the bounds of --hold pick; original-priority: original with vLLM priorities by new prompt length)."),
    model: str = typer.Option("tiny", "--model", help="Served model name."),
    multi_turn: bool | None = typer.Option(None, "--multi-turn/--independent", help="Override the trace's flag."),
    seed: int = typer.Option(0, "--seed", help="Seed of the Poisson arrivals."),
    rounds: int = typer.Option(1, "--rounds", min=1, max=10, help="Repeat the strategies (ABBA order), pooled."),
    plot: Path | None = typer.Option(None, "--plot", help="Write the TTFT CDF per strategy (PNG)."),
    per_request: Path | None = typer.Option(
        None, "--per-request",
        help="Write every request of every strategy's run (strategy, conversation, turn, replica, send time, TTFT, "
             "latency, prompt and cached tokens, error; not --load's calibration) to this file, one JSON object a line."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Replay a trace through the proxy and straight to the engines; print TTFT, throughput, errors, lost blocks."""
    from rich.console import Console
    from rich.markup import escape

    from cpmemory.bench import report as report_module

    err = report_module.stderr_console()
    try:
        trace = _load(trace_file, workload, data_dir, multi_turn)
        settings = ServeSettings(
            engines=tuple(engine), upstream=upstream, proxy=proxy, kv_events=tuple(kv_events or ()), tokenizer=tokenizer,
            hold=hold, upstream_kind=upstream_kind, upstream_session=upstream_session, original_routing=original_routing,
            proxy_config=read_config_file(config_file) if config_file is not None else {},
            concurrency=concurrency, rate=min(rate) if rate else None, requests=requests, max_turns=max_turns, max_tokens=max_tokens,
            timeout_s=timeout, engine_timeout_s=engine_timeout, model=model, seed=seed, rounds=rounds,
            strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()))
        if settings.kv_events and len(settings.kv_events) != len(settings.engines):
            raise CpMemoryError("give one --kv-events endpoint per --engine, in the same order")
        if settings.proxy is None:
            proxy_config(settings)  # the proxy's own rules (ServerConfig), before any strategy runs
        if len(set(rate or ())) != len(rate or ()):
            raise CpMemoryError("give each --rate once")
        if len(set(load or ())) != len(load or ()):
            raise CpMemoryError("give each --load once")
        if rate and load:
            raise CpMemoryError("give --rate or --load, not both")
        rates: list[tuple[float | None, float | None]] = [(None, one) for one in sorted(rate)] if rate else [(None, None)]
        per_run = min(requests, len(trace.requests))
        calibrating = min(calibrate_requests, per_run) if load else 0
        total = calibrating + per_run * len(settings.strategies) * rounds * len(load or rates)
        reports, capacity = [], None
        ttfts: dict[str, Any] = {}
        records: list[dict[str, Any]] = []
        with report_module.progress_bar(total, f"serve {trace.name}") as advance:
            if load:
                capacity = asyncio.run(measure_capacity(trace, settings, calibrate_requests,
                                                        lambda name, outcome: advance(1)))
                rates = [(fraction, one) for fraction, one in load_rates(load, capacity["throughput_rps"])]
                err.print(f"capacity (original, {capacity['concurrency']} clients, {capacity['requests']} requests): "
                          f"{capacity['throughput_rps']:.3f} req/s -> rates "
                          + ", ".join(f"{one:g}/s" for _, one in rates))
            for fraction, one_rate in rates:
                ttfts = {name: [] for name in settings.strategies}  # the CDF plots the last (highest) rate

                def progress(name: str, outcome: Outcome, ttfts: dict[str, list[float]] = ttfts,
                             one_rate: float | None = one_rate) -> None:
                    if outcome.ttft_ms is not None:
                        ttfts[name].append(outcome.ttft_ms)
                    if per_request is not None:
                        records.append(request_record(name, outcome, one_rate))
                    advance(1)

                one = asyncio.run(run_serve(trace, settings.model_copy(update={"rate": one_rate}), progress))
                reports.append({**one, "load": fraction, "capacity": capacity} if fraction is not None else one)
    except (CpMemoryError, ImportError, ValueError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(code=2) from exc
    if per_request is not None:
        per_request.write_text("".join(json.dumps(record) + "\n" for record in records))
    report = reports[-1] if len(reports) == 1 else {**reports[-1], "sweep": sweep_rows(reports)}
    console = Console(stderr=True, width=160) if json_output else Console(width=160)
    if plot is not None:
        if len(reports) > 1:
            plot_sweep(report, plot)
        else:
            plot_cdf(report, ttfts, plot)
    for one in reports:
        print_table(one, console)
    if len(reports) > 1:
        print_sweep(report, console)
    if json_output:
        sys.stdout.write(report_module.json_line(report) + "\n")
