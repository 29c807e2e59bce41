"""The research commands under ``cpmemory bench``: ``register`` adds each one whose module is present.

A command module exposes ``command`` (a typer callback). The list below names them; a module that is not there (a
study being written, or one removed) is left out, and one whose dependencies are missing says so when run, rather
than failing the whole command line.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

import typer


class Study(NamedTuple):
    name: str
    module: str
    help: str


STUDIES: tuple[Study, ...] = (
    Study("replay", "cpmemory_benchmarks.replay", "Replay a trace or a real workload through every strategy."),
    Study("hold", "cpmemory_benchmarks.hold_bench",
          "The proxy's hold-and-release queue on and off: cached share, same run."),
    Study("accuracy", "cpmemory_benchmarks.accuracy", "Answer accuracy with and without cpmemory on a real model."),
    Study("hosted", "cpmemory_benchmarks.hosted", "Hosted providers' prompt caches with and without cpmemory."),
)


def register(bench_app: typer.Typer) -> list[str]:
    """Add every study whose module is present to ``bench_app``; return the names added.

    A study whose own module is absent is left out. One whose module needs a package that is not installed is still
    listed, and says which package when it is run (the rest of the command line keeps working).
    """
    added = []
    for study in STUDIES:
        try:
            module = importlib.import_module(study.module)
        except ModuleNotFoundError as error:
            if error.name == study.module:
                continue
            bench_app.command(study.name, help=f"{study.help} (needs {error.name})", context_settings=_ANY_ARGS)(
                _missing(study.name, str(error.name)))
        else:
            bench_app.command(study.name, help=study.help)(module.command)
        added.append(study.name)
    return added


_ANY_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


def _missing(name: str, package: str) -> Callable[[], None]:
    def command() -> None:
        typer.echo(f"`cpmemory bench {name}` needs {package}, which is not installed.", err=True)
        raise typer.Exit(2)

    return command
