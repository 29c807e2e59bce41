"""Mem0 integration: wrap ``mem0.Memory`` / ``AsyncMemory`` / ``MemoryClient`` so searches go through cpmemory.

Needs the ``mem0`` extra (``pip install 'cpmemory[mem0]'``); importing this package without it raises
:class:`cpmemory.errors.MissingDependencyError` naming that command.
"""

from __future__ import annotations

import importlib.util

from cpmemory.errors import MissingDependencyError

# A presence check, not an import: importing mem0 costs seconds and creates its home folder, and the adapter is
# duck-typed (it only calls the wrapped object's methods).
if importlib.util.find_spec("mem0") is None:
    raise MissingDependencyError("mem0", "mem0ai")

from integrations._common import PassthroughWarning
from integrations.mem0.results import ParsedResults, parse_search_results
from integrations.mem0.wrapper import AsyncCpMemoryMem0, CpMemoryMem0, PassthroughTurn

__all__ = [
    "AsyncCpMemoryMem0",
    "CpMemoryMem0",
    "ParsedResults",
    "PassthroughTurn",
    "PassthroughWarning",
    "parse_search_results",
]
