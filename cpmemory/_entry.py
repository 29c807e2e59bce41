"""The ``cpmemory`` console script: the command line needs the ``cli`` extra (typer, rich); say so if it is missing."""
from __future__ import annotations

import importlib.util
import sys


def main() -> None:  # pragma: no cover - console entry point
    """Run the command line, or print the install command when its packages are missing."""
    missing = [name for name in ("typer", "rich") if importlib.util.find_spec(name) is None]
    if missing:
        sys.stderr.write(f"the cpmemory command needs {', '.join(missing)}: pip install -e '.[cli]' (in a cpmemory checkout)\n")
        raise SystemExit(2)
    from cpmemory.cli import main as cli_main

    cli_main()
