"""Placeholder command: replaced by the owning work stream."""
from __future__ import annotations

import typer


def command(json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout.")) -> None:
    """Not built yet."""
    raise typer.Exit(code=2)
