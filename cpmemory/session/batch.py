"""Offline batch planning for the facade: reorder many requests and choose their execution order.

Uses the best algorithm importable: the PLANNER stream's ``cpmemory.core.planner.plan_batch``, else the paper's
pipeline from CORE (``cpmemory.core.ordering.reorder_batch`` + ``cpmemory.core.scheduling.schedule``), else the
identity (relevance order, arrival order). Contexts are lists of content hashes, mapped back to block ids here.
"""

from __future__ import annotations

from collections.abc import Sequence

from cpmemory.core.blocks import Block


def _keyed(blocks: Sequence[Block]) -> tuple[list[str], dict[str, str]]:
    """Distinct content hashes in rank order, and hash -> id of its best-ranked block."""
    first: dict[str, str] = {}
    for block in blocks:
        first.setdefault(block.content_hash, block.id)
    return list(first), first


def _plan_hashes(contexts: list[list[str]], alpha: float) -> tuple[list[int], list[list[str]]]:
    try:
        from cpmemory.core.planner import plan_batch
    except ImportError:
        plan_batch = None
    if plan_batch is not None:
        plan = plan_batch(contexts)
        return list(plan.order), [list(context) for context in plan.contexts]
    try:
        from cpmemory.core.ordering import reorder_batch
        from cpmemory.core.scheduling import schedule
    except ImportError:
        return list(range(len(contexts))), contexts
    ordering = reorder_batch(contexts, alpha=alpha)
    return list(schedule(ordering.search_paths)), [list(context) for context in ordering.contexts]


def plan_contexts(block_lists: Sequence[Sequence[Block]], alpha: float) -> tuple[list[int], list[list[str]]]:
    """Return (execution order, each request's block ids reordered). Pure.

    Blocks sharing content travel together (the duplicate follows its first occurrence); every output list is a
    permutation of its request's ids.
    """
    keyed = [_keyed(blocks) for blocks in block_lists]
    non_empty = [i for i, (hashes, _) in enumerate(keyed) if hashes]
    order_sub, planned = _plan_hashes([keyed[i][0] for i in non_empty], alpha) if non_empty else ([], [])
    id_lists: list[list[str]] = [[] for _ in block_lists]
    for position, i in enumerate(non_empty):
        by_hash: dict[str, list[str]] = {}
        for block in block_lists[i]:
            by_hash.setdefault(block.content_hash, []).append(block.id)
        id_lists[i] = [block_id for digest in planned[position] for block_id in by_hash[digest]]
    order = [non_empty[j] for j in order_sub] + [i for i, (hashes, _) in enumerate(keyed) if not hashes]
    return order, id_lists
