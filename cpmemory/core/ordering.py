"""Context ordering (paper Algorithm 2 / Algorithm 4 phase 3): shared prefix first, the rest in relevance order.

The order annotation that tells the model the original ranking is written by :mod:`cpmemory.core.annotations`;
this module only decides the order of the block keys.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from cpmemory.core.distance import DEFAULT_ALPHA
from cpmemory.core.index import BuildOptions, ContextIndex

__all__ = ["BatchOrdering", "reorder", "reorder_batch"]


@dataclass(frozen=True, slots=True)
class BatchOrdering:
    """The offline pipeline's result.

    Attributes:
        contexts: each input context reordered (a permutation of its distinct keys).
        search_paths: each context's leaf path in the index built from the batch (for :func:`schedule`).
        index: the index built from the batch (its request ids are the input positions).
    """

    contexts: list[list[Hashable]]
    search_paths: list[tuple[int, ...]]
    index: ContextIndex


def reorder(context: Iterable[Hashable], prefix: Iterable[Hashable]) -> list[Hashable]:
    """Return ``context`` with the ``prefix`` blocks it holds first (in prefix order), then the rest in order.

    Pure, O(|context| + |prefix|). Repeated keys keep their first occurrence; prefix keys the context does not
    hold are skipped, so the result is always a permutation of the context's distinct keys.
    """
    keys = list(dict.fromkeys(context))
    present = set(keys)
    head = [key for key in dict.fromkeys(prefix) if key in present]
    placed = set(head)
    return head + [key for key in keys if key not in placed]


def reorder_batch(
    contexts: Sequence[Sequence[Hashable]],
    alpha: float = DEFAULT_ALPHA,
    *,
    options: BuildOptions | None = None,
) -> BatchOrdering:
    """Build an index over ``contexts``, align it and reorder every context by its leaf (pure w.r.t. inputs).

    Contexts with the same set of blocks come out identical (they share a leaf), so the second one is a full
    prefix hit. O(build) + O(total blocks).
    """
    index = ContextIndex.build(contexts, alpha=alpha, options=options)
    ordered: list[list[Hashable]] = []
    paths: list[tuple[int, ...]] = []
    for position, context in enumerate(contexts):
        found = index.lookup(position)
        assert found is not None
        ordered.append(reorder(context, found.prefix))
        paths.append(found.path)
    return BatchOrdering(ordered, paths, index)
