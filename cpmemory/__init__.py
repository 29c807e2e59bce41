"""cpmemory: context reuse for long-context LLM agents (ContextPilot-style reorder, schedule, de-duplicate)."""
from __future__ import annotations

from cpmemory.core.blocks import Block, normalize_blocks
from cpmemory.errors import CpMemoryError

__all__ = ["Block", "CpMemoryError", "normalize_blocks"]
__version__ = "0.1.0"
