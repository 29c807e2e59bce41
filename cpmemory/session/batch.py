"""Offline batch planning for the facade: reorder many requests and choose their execution order.

Uses ``cpmemory.core.planner.plan_batch`` on lists of content hashes; the result is mapped back to block ids here.
"""

from __future__ import annotations

from collections.abc import Sequence

from cpmemory.core.blocks import Block
from cpmemory.core.planner import plan_batch


def _keyed(blocks: Sequence[Block]) -> tuple[list[str], dict[str, str]]:
    """Distinct content hashes in rank order, and hash -> id of its best-ranked block."""
    first: dict[str, str] = {}
    for block in blocks:
        first.setdefault(block.content_hash, block.id)
    return list(first), first


def _plan_hashes(contexts: list[list[str]]) -> tuple[list[int], list[list[str]]]:
    plan = plan_batch(contexts)
    return list(plan.order), [list(context) for context in plan.contexts]


def plan_contexts(block_lists: Sequence[Sequence[Block]]) -> tuple[list[int], list[list[str]]]:
    """Return (execution order, each request's block ids reordered). Pure.

    Blocks sharing content travel together (the duplicate follows its first occurrence); every output list is a
    permutation of its request's ids.
    """
    keyed = [_keyed(blocks) for blocks in block_lists]
    non_empty = [i for i, (hashes, _) in enumerate(keyed) if hashes]
    order_sub, planned = _plan_hashes([keyed[i][0] for i in non_empty]) if non_empty else ([], [])
    id_lists: list[list[str]] = [[] for _ in block_lists]
    for position, i in enumerate(non_empty):
        by_hash: dict[str, list[str]] = {}
        for block in block_lists[i]:
            by_hash.setdefault(block.content_hash, []).append(block.id)
        id_lists[i] = [block_id for digest in planned[position] for block_id in by_hash[digest]]
    order = [non_empty[j] for j in order_sub] + [i for i, (hashes, _) in enumerate(keyed) if not hashes]
    return order, id_lists
