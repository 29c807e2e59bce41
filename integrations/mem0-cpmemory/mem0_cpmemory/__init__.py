"""Mem0 integration: wrap ``mem0.Memory`` / ``AsyncMemory`` / ``MemoryClient`` so searches go through cpmemory.

The ``mem0-cpmemory`` distribution (from a checkout: ``pip install -e . -e integrations/mem0-cpmemory``). It uses only cpmemory's public
API (``cpmemory`` and :mod:`cpmemory.adapters`). Importing this package without mem0ai (an install with
``--no-deps``) raises :class:`cpmemory.errors.MissingDependencyError` naming the install command.
"""

from __future__ import annotations

import importlib.util

from cpmemory.errors import MissingDependencyError

# A presence check, not an import: importing mem0 costs seconds and creates its home folder, and the adapter is
# duck-typed (it only calls the wrapped object's methods).
if importlib.util.find_spec("mem0") is None:
    raise MissingDependencyError("mem0", "mem0ai", "pip install -e . -e integrations/mem0-cpmemory (in a cpmemory checkout)")

from cpmemory.adapters import PassthroughWarning
from mem0_cpmemory.results import ParsedResults, parse_search_results
from mem0_cpmemory.wrapper import AsyncCpMemoryMem0, CpMemoryMem0, PassthroughTurn, RunIdFilterWarning

__all__ = [
    "AsyncCpMemoryMem0",
    "CpMemoryMem0",
    "ParsedResults",
    "PassthroughTurn",
    "PassthroughWarning",
    "RunIdFilterWarning",
    "parse_search_results",
]
