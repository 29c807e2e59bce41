"""cpmemory: context reuse for long-context LLM agents (ContextPilot-style reorder, schedule, de-duplicate)."""
from __future__ import annotations

from cpmemory._version import __version__
from cpmemory.core.blocks import Block, normalize_blocks
from cpmemory.errors import (
    CpMemoryError,
    InvalidBlockError,
    InvalidIdentifierError,
    InvalidInputError,
    ReservationError,
    ReservationExpiredError,
    StoreUnavailableError,
    UnknownReservationError,
)
from cpmemory.facade import AsyncCpMemory, CpMemory
from cpmemory.session.config import CpMemoryConfig
from cpmemory.session.turns import BlockDecision, PreparedTurn
from cpmemory.types import BatchPlan, BlockStatus, Status

__all__ = [
    "AsyncCpMemory",
    "BatchPlan",
    "Block",
    "BlockDecision",
    "BlockStatus",
    "CpMemory",
    "CpMemoryConfig",
    "CpMemoryError",
    "InvalidBlockError",
    "InvalidIdentifierError",
    "InvalidInputError",
    "PreparedTurn",
    "ReservationError",
    "ReservationExpiredError",
    "Status",
    "StoreUnavailableError",
    "UnknownReservationError",
    "__version__",
    "normalize_blocks",
]
