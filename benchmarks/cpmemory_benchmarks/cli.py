"""The research commands under ``cpmemory bench``: ``register`` adds each one whose module is present.

A command module exposes ``command`` (a typer callback). The list below names them; a module that is not there (a
study being written, or one removed) is left out rather than failing the whole command line.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

import typer


class Study(NamedTuple):
    name: str
    module: str
    help: str


STUDIES: tuple[Study, ...] = (
    Study("replay", "cpmemory_benchmarks.replay", "Replay a trace or a real workload through every strategy."),
    Study("accuracy", "cpmemory_benchmarks.accuracy", "Answer accuracy with and without cpmemory on a real model."),
    Study("hosted", "cpmemory_benchmarks.hosted", "Hosted providers' prompt caches with and without cpmemory."),
)


def register(bench_app: typer.Typer) -> list[str]:
    """Add every study whose module imports to ``bench_app``; return the names added."""
    added = []
    for study in STUDIES:
        try:
            module = importlib.import_module(study.module)
        except ModuleNotFoundError as error:
            if error.name == study.module:
                continue  # the study's own module is absent; a missing dependency inside it still raises
            raise
        bench_app.command(study.name, help=study.help)(module.command)
        added.append(study.name)
    return added
