"""The authors' ``contextpilot`` package (PyPI ``contextpilot==0.5.0``) as the peer strategy.

Installed by the bench extra with ``--no-deps`` (its index code needs only numpy/scipy/tqdm); never a core
dependency. A fresh ``ContextPilot`` instance is used for every run, because reusing one returns its results in a
different order. Each output context is checked to be a permutation of its input; the execution order the package
returns (``original_indices``) is used as the schedule.
"""
from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from cpmemory.errors import InvalidInputError, MissingDependencyError


@dataclass(frozen=True, slots=True)
class PeerPlan:
    """The package's result: ``order`` (execution order, indices into the input) and each input's reordered ids."""

    order: list[int]
    contexts: list[list[Hashable]]


def contextpilot_available() -> bool:
    """Return True when the ``contextpilot`` package can be imported."""
    try:
        import contextpilot  # noqa: F401
    except ImportError:
        return False
    return True


def plan_with_contextpilot(contexts: Sequence[Sequence[Hashable]], alpha: float = 0.001) -> PeerPlan:
    """Reorder ``contexts`` with a fresh ``contextpilot.ContextPilot`` and return its order and contexts.

    Block keys are mapped to dense integers for the package and mapped back. Its console output is swallowed.

    Raises:
        MissingDependencyError: the package is not installed.
        InvalidInputError: the package returned something other than a permutation of each input / of the batch.
    """
    try:
        from contextpilot.server.live_index import ContextPilot
    except ImportError as exc:
        raise MissingDependencyError("bench", "contextpilot") from exc
    vocabulary: dict[Hashable, int] = {}
    encoded = [[vocabulary.setdefault(key, len(vocabulary)) for key in context] for context in contexts]
    decode = {value: key for key, value in vocabulary.items()}
    nonempty = [index for index, context in enumerate(encoded) if context]
    if not nonempty:
        return PeerPlan(list(range(len(contexts))), [list(context) for context in contexts])
    sink = io.StringIO()
    logger = logging.getLogger("contextpilot")
    previous_level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            reordered, original_indices = ContextPilot(alpha=alpha, use_gpu=False).reorder(
                [encoded[index] for index in nonempty])
    finally:
        logger.setLevel(previous_level)
    return _decode(contexts, nonempty, reordered, original_indices, decode)


def _decode(contexts: Sequence[Sequence[Hashable]], nonempty: list[int], reordered, original_indices,
            decode: dict[int, Hashable]) -> PeerPlan:
    original_indices = [int(index) for index in original_indices]
    if sorted(original_indices) != list(range(len(nonempty))) or len(reordered) != len(nonempty):
        raise InvalidInputError("contextpilot returned an execution order that is not a permutation of the batch")
    out = [list(context) for context in contexts]
    for position, local in enumerate(original_indices):
        index = nonempty[local]
        candidate = [decode[int(value)] for value in reordered[position]]
        if sorted(map(repr, candidate)) != sorted(map(repr, contexts[index])):
            raise InvalidInputError(f"contextpilot returned a context for request {index} that is not a permutation")
        out[index] = candidate
    empty = [index for index, context in enumerate(contexts) if not context]
    return PeerPlan([nonempty[local] for local in original_indices] + empty, out)
