"""Exceptions raised by cpmemory.

Hierarchy::

    CpMemoryError
    ├── InvalidInputError (also ValueError)     bad caller input; nothing was changed
    │   ├── InvalidBlockError                   a block that cannot be used (bad id type, bad text type)
    │   ├── InvalidIdentifierError              hostile or malformed tenant / conversation id
    │   ├── TraceFormatError                    a malformed trace line (carries line number)
    │   ├── TokenCounterError                   the token counter raised, or returned a negative or non-integer
    │   └── PromptBudgetError                   the turn cannot fit the token budget (checked before reserving)
    ├── ReservationError                        two-phase turn misuse
    │   ├── UnknownReservationError             commit/abort for a reservation never made or already released
    │   └── ReservationExpiredError             commit after the reservation timed out
    ├── IndexIntegrityError                     the context index is corrupt (a bug, never expected)
    ├── StoreUnavailableError                   the session store (Redis) cannot be reached; callers degrade
    ├── EngineError                             an engine replica failed or timed out
    │   ├── EngineUnreachableError              no answer (connection error, timeout, 502-504): try another replica
    │   ├── EngineStatusError                   the engine answered with an error status (the request is at fault)
    │   └── NoHealthyReplicaError               every replica is down
    ├── KVEventError                            a malformed KV-event frame
    └── MissingDependencyError (also ImportError)  an optional extra is not installed; names the pip command

Expected outcomes (a cache miss, an expired conversation) are return values, not exceptions.
"""
from __future__ import annotations


class CpMemoryError(Exception):
    """Root of every error raised by cpmemory."""


class InvalidInputError(CpMemoryError, ValueError):
    """The caller passed input cpmemory cannot use. No state was changed."""


class InvalidBlockError(InvalidInputError):
    """A context block is malformed (id or text of the wrong type, ...)."""


class InvalidIdentifierError(InvalidInputError):
    """A tenant or conversation identifier is empty, too long or not a string."""


class TraceFormatError(InvalidInputError):
    """A trace line could not be parsed."""

    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"trace line {line_number}: {reason}")
        self.line_number = line_number
        self.reason = reason


class TokenCounterError(InvalidInputError):
    """The token counter raised, or returned something other than a non-negative int (nothing was reserved)."""


class PromptBudgetError(InvalidInputError):
    """A prompt cannot fit the token budget: a non-positive budget, one block larger than the budget, or the new turn
    alone (system prompt, every block in full, annotations, question) over it. Raised before anything is reserved.

    Attributes:
        budget: the budget in tokens.
        needed: the tokens the smallest possible prompt needs (0 when unknown).
    """

    def __init__(self, message: str, budget: int = 0, needed: int = 0) -> None:
        super().__init__(message)
        self.budget = budget
        self.needed = needed


class ReservationError(CpMemoryError):
    """A two-phase turn was used out of order."""


class UnknownReservationError(ReservationError, KeyError):
    """commit/abort named a reservation that does not exist (never made, or already released)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown reservation"


class ReservationExpiredError(ReservationError):
    """The reservation timed out before commit; nothing of it was recorded."""


class IndexIntegrityError(CpMemoryError):
    """The context index violates one of its invariants."""


class StoreUnavailableError(CpMemoryError):
    """The session store could not be reached or timed out."""


class EngineError(CpMemoryError):
    """An engine replica returned an error or did not answer in time."""


class EngineUnreachableError(EngineError):
    """The replica did not answer (connection error, timeout, gateway error). Safe to retry on another replica."""


class EngineStatusError(EngineError):
    """The engine answered with an HTTP error status. ``body`` is kept as received (str or bytes)."""

    def __init__(self, status_code: int, body: str | bytes = "", url: str = "engine") -> None:
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        super().__init__(f"{url} answered HTTP {status_code}: {text[:300]}")
        self.status_code = status_code
        self.body = body
        self.url = url


class EngineGatewayError(EngineUnreachableError, EngineStatusError):
    """The replica answered 502, 503 or 504: a status error that is also safe to retry on another replica."""


class NoHealthyReplicaError(EngineError):
    """No engine replica is available."""


class KVEventError(CpMemoryError):
    """A KV-cache event frame could not be decoded."""


class MissingDependencyError(CpMemoryError, ImportError):
    """An optional dependency is missing; the message names the install command (from a checkout: cpmemory is
    not on a package registry)."""

    def __init__(self, extra: str, package: str, command: str | None = None) -> None:
        """Name the missing ``package`` and the command that installs it (default: cpmemory's ``extra``)."""
        command = command or f"pip install -e '.[{extra}]' (in a cpmemory checkout)"
        super().__init__(f"{package} is not installed; run: {command}")
        self.extra = extra
        self.package = package
