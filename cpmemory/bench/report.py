"""What the benchmarks print: progress bars and errors (stderr), one JSON line (stdout), matplotlib for plots."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cpmemory.errors import MissingDependencyError


def stderr_console() -> Console:
    """A console on stderr (progress and errors never mix with the JSON on stdout)."""
    return Console(stderr=True)


@contextlib.contextmanager
def progress_bar(total: int, description: str) -> Iterator[Callable[[int], None]]:
    """Show a progress bar on stderr; yields ``advance(steps)``."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=stderr_console(), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda steps: progress.advance(task, steps)


def json_line(obj: Any) -> str:
    """One-line JSON (a checker reads the last ``{`` line of stdout)."""
    return json.dumps(obj, separators=(", ", ": "))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependencyError("bench", "matplotlib") from exc
    return plt
