"""The ``cpmemory`` command line.

Each command's options and body live in the module that owns the feature; this file only wires them up.
Command modules import only core dependencies at module level; optional extras are imported inside the command.
"""
from __future__ import annotations

from importlib.metadata import entry_points

import typer

from cpmemory.bench import conversation, core_bench, demo, load, plan_bench, serve, store_bench
from cpmemory.server import command as serve_command
from cpmemory.testing import mock_server

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Context reuse for long-context LLM agents.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures (tables, or one JSON object).")
app.add_typer(bench_app, name="bench")

app.command("demo", help="Run the embedded default end to end and compare with the original order.")(demo.command)
app.command("serve", help="Start the OpenAI-compatible proxy in front of one or more engines.")(serve_command.command)
app.command("mock-engine", help="Serve a mock OpenAI-compatible engine (no GPU, no model) to try the proxy.")(mock_server.command)
bench_app.command("core", help="Index build / search / reorder / dedup speed and memory.")(core_bench.command)
bench_app.command("store", help="Session store latency and round trips (memory, Redis, Redis Cluster).")(
    store_bench.command
)
bench_app.command("conversation", help="One long conversation under a token budget: latency, prompt size, prefill.")(
    conversation.command
)
bench_app.command("plan", help="plan_batch time and memory on a large seeded batch.")(plan_bench.command)
bench_app.command("load", help="Concurrent conversations through the proxy: overhead, errors, lost blocks.")(
    load.command
)
bench_app.command("serve", help="Replay a trace through the proxy on real engines: TTFT, throughput, errors, lost.")(
    serve.command
)

# The research commands (trace replay, studies) live in the unshipped distribution `benchmarks/`
# (cpmemory-benchmarks); it adds them through this entry-point group. Without it, these names say how to install it.
BENCH_PLUGINS = "cpmemory.bench"
RESEARCH_COMMANDS = ("replay", "hold", "accuracy", "hosted")
INSTALL_HINT = (
    "`cpmemory bench {name}` is a research benchmark: it lives in benchmarks/ (cpmemory-benchmarks), not in the "
    "cpmemory package. From a checkout: `make setup`, or `pip install -e benchmarks`."
)


def _not_installed(name: str):
    def command() -> None:
        typer.echo(INSTALL_HINT.format(name=name), err=True)
        raise typer.Exit(2)

    return command


def _register_research(bench: typer.Typer) -> None:
    plugins = entry_points(group=BENCH_PLUGINS)
    for plugin in plugins:
        plugin.load()(bench)
    if not plugins:
        for name in RESEARCH_COMMANDS:
            bench.command(name, help="Research benchmark: needs cpmemory-benchmarks (benchmarks/).",
                          context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
                _not_installed(name))


_register_research(bench_app)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
