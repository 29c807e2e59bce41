"""Offline batch planner: order each request's blocks and the requests themselves to maximise prefix-cache hits.

Why a prefix tree: an exact-prefix cache (SGLang's radix tree, vLLM's chained block hashes) lets a request reuse
only a prefix it shares with *one* earlier request, so whatever the cache holds is part of the prefix tree (trie) of
the prompts seen so far. If the requests run in depth-first (lexicographic) order of that trie, each request
reuses its whole path down to where it leaves its predecessor, and a trie node is never needed again once its
subtree is done: an LRU cache evicts exactly the finished branches and only has to hold the current path. The hit
rate then reaches ``1 - tokens(trie) / tokens(all prompts)`` under any cache larger than one prompt, which is the
best any schedule can do for those block orders. Planning is therefore the choice of each request's block order
that makes the trie small (token-weighted), followed by a lexicographic schedule.

Two trie builders (see :mod:`cpmemory.core.planner_tree`) capture the two kinds of sharing found in real traces:

* a *core tree* grown by lazy Kruskal over token-weighted pairwise overlaps (clusters of similar requests, where
  the paper's clustering wins, e.g. LoCoMo), and
* a *conditional-frequency split*, top-down like a decision tree (global popularity, e.g. MultiHop-RAG).

The planner builds both, plus the retrieval order and a popularity sort as fallbacks, and keeps the one whose trie
saves most tokens, computed exactly from the orders (sum of token-weighted common prefixes of lexicographic
neighbours). It then improves that trie by local search (:mod:`cpmemory.core.planner_search`: subtree
prune-and-regraft moves with a perturbation ratchet), which only ever raises the tokens saved; on sampled sub-batches
small enough to solve exactly the result comes close to the optimum (``cpmemory_benchmarks.studies.planner_ceiling``).
This is a choice by the objective, not by workload; with an unbounded cache the reuse of a set of
orders does not depend on the schedule, and the lexicographic schedule attains it under any cache holding one
prompt, so the plan never reuses fewer block tokens than retrieval order or a popularity sort would.

After the schedule is fixed, every block beyond the prefix a request shares with its schedule neighbours goes back
to retrieval order (nobody reuses it), so the relevance order changes only where it buys reuse, and a request that
shares nothing is sent as retrieved, without an order annotation. Inside a shared prefix, blocks go by their mean
retrieval rank in the batch (the more relevant first), which also spares some order annotations.

Multi-turn sessions (``sessions`` given): a later turn carries its session's history as its prompt prefix, so only
a session's first turn can share a prefix with other sessions. Sessions are planned as units keyed by their first
turn, and all turns of a session run back to back in their order, so the history just inserted is still cached.
Only first turns are reordered; later turns keep their block order (no other session can share it).

Pure (no IO, no state) and deterministic. Cost: one sparse matrix product plus O(P log P) for P candidate pairs
(16 per request), O(R * K * depth) for the split, and O(R^2 K) numpy work per search pass, for R requests of K
blocks per group of connected requests; the ratchet multiplies the search passes.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping, Sequence
from itertools import pairwise

from cpmemory.core.planner_search import improve_orders
from cpmemory.core.planner_tree import (
    build_core_tree,
    build_split_orders,
    common_prefix,
    core_tree_orders,
    first_seen_ranks,
    remaining_blocks,
)
from cpmemory.errors import InvalidInputError
from cpmemory.types import BatchPlan

Context = Sequence[Hashable]
LARGE_BATCH = 5_000
"""Above this many planning units the core tree (pairwise overlaps) and the local search (quadratic per group)
are skipped: the split, retrieval order and popularity candidates scale as O(R K log R); at or below it the
plan is exactly the full planner's."""


def trie_savings(
    orders: Sequence[Context], weights: Mapping[Hashable, float], ranks: Mapping[Hashable, int]
) -> tuple[float, list[int]]:
    """Return ``(tokens reused, lexicographic order)`` for the given block orders run depth-first.

    The tokens reused are the sum, over lexicographic neighbours, of the token weight of their common block prefix
    (a sorted list's best earlier match is its predecessor). Pure; O(R K log R).
    """
    keyed = [tuple(ranks[block] for block in order) for order in orders]
    schedule = sorted(range(len(orders)), key=lambda index: (keyed[index], index))
    saved = 0.0
    for previous, current in pairwise(schedule):
        for a, b in zip(orders[previous], orders[current]):
            if a != b:
                break
            saved += weights.get(a, 1.0)
    return saved, schedule


RATCHET_STEPS = 4
"""Default perturb-and-climb rounds of the local search, per group of connected requests."""


def _plan_units(
    contexts: Sequence[Context], weights: Mapping[Hashable, float], ratchet_steps: int = RATCHET_STEPS
) -> tuple[list[int], list[list]]:
    """Plan independent requests: build both tries, keep the one that saves more, improve it by local search;
    return (order, orders)."""
    ranks = first_seen_ranks(contexts)
    popularity: defaultdict[Hashable, float] = defaultdict(float)
    rank_sum: Counter = Counter()
    for context in contexts:
        for position, block in enumerate(dict.fromkeys(context)):
            popularity[block] += weights.get(block, 1.0)
            rank_sum[block] += position
    mean_rank = {block: rank_sum[block] * weights.get(block, 1.0) / popularity[block] for block in popularity}
    large = len(contexts) > LARGE_BATCH
    candidates = [] if large else [
        core_tree_orders(build_core_tree(contexts, weights, ranks), contexts, ranks,
                         {block: -rank for block, rank in mean_rank.items()}),
    ]
    candidates += [
        build_split_orders(contexts, weights, ranks),
        # the baselines' orders too: the kept plan never reuses less than retrieval order or a popularity sort
        [list(context) for context in contexts],
        [sorted(context, key=lambda block: (-popularity[block], ranks[block])) for context in contexts],
    ]
    best: tuple[float, list[int], list[list]] | None = None
    for orders in candidates:
        saved, schedule = trie_savings(orders, weights, ranks)
        if best is None or saved > best[0]:
            best = (saved, schedule, orders)
    assert best is not None
    if not large:
        priority = {block: -rank for block, rank in mean_rank.items()}
        searched, _ = improve_orders(contexts, best[2], weights, priority, ratchet_steps=ratchet_steps)
        saved, schedule = trie_savings(searched, weights, ranks)
        if saved > best[0]:
            best = (saved, schedule, searched)
    schedule, orders = best[1], best[2]
    return schedule, restore_unshared_tails(contexts, orders, schedule)


def restore_unshared_tails(
    contexts: Sequence[Context], orders: Sequence[Context], schedule: Sequence[int]
) -> list[list]:
    """Put back in retrieval order every block that no schedule neighbour shares as a prefix. Pure; O(R K).

    Under the lexicographic schedule a request reuses its common prefix with its predecessor and lends its common
    prefix with its successor; blocks after both are reused by nobody, so they keep the relevance order. A request
    that shares nothing gets its input order back, and its prompt needs no order annotation.
    """
    shared = [0] * len(orders)
    for previous, current in pairwise(schedule):
        length = common_prefix(orders[previous], orders[current])
        shared[previous] = max(shared[previous], length)
        shared[current] = max(shared[current], length)
    out = []
    for index, (context, order) in enumerate(zip(contexts, orders)):
        prefix = list(order[: shared[index]])
        out.append(prefix + remaining_blocks(context, prefix))
    return out


def _validate(contexts: Sequence[Context], sessions: Sequence[Hashable] | None) -> None:
    if isinstance(contexts, (str, bytes)):
        raise InvalidInputError("contexts must be a list of block lists")
    for index, context in enumerate(contexts):
        if isinstance(context, (str, bytes)):
            raise InvalidInputError(f"context {index} must be a list of block keys, not a string")
    if sessions is not None and len(sessions) != len(contexts):
        raise InvalidInputError(f"sessions has {len(sessions)} entries for {len(contexts)} contexts")


def plan_batch(
    contexts: Sequence[Context],
    *,
    sessions: Sequence[Hashable] | None = None,
    token_counts: Mapping[Hashable, float] | None = None,
    ratchet_steps: int = RATCHET_STEPS,
) -> BatchPlan:
    """Plan the block order of each context and the execution order of the batch (see the module docstring).

    Args:
        contexts: each request's blocks (hashable keys, e.g. content hashes) in retrieval order.
        sessions: optional session key per request; requests of a session are turns of one conversation (history
            is their prompt prefix), keep their relative order and run back to back.
        token_counts: optional tokens per block key (default 1 each): weighs a block's value as a shared prefix.
        ratchet_steps: perturb-and-climb rounds of the local search (:mod:`cpmemory.core.planner_search`) per group
            of connected requests; 0 keeps only the SPR climb (faster, slightly less reuse).

    Returns:
        A BatchPlan; every planned context is a permutation of its input. Pure and deterministic.

    Raises:
        InvalidInputError: when a context is a string or ``sessions`` does not match ``contexts`` in length.
    """
    _validate(contexts, sessions)
    contexts = [list(context) for context in contexts]
    weights = token_counts or {}
    if not contexts:
        return BatchPlan([], [])
    if sessions is None:
        order, orders = _plan_units(contexts, weights, ratchet_steps)
        return BatchPlan(order, orders)
    turns: dict[Hashable, list[int]] = {}
    for index, session in enumerate(sessions):
        turns.setdefault(session, []).append(index)
    heads = [members[0] for members in turns.values()]
    unit_order, unit_orders = _plan_units([contexts[head] for head in heads], weights, ratchet_steps)
    planned = [list(context) for context in contexts]
    order = []
    for unit in unit_order:
        planned[heads[unit]] = unit_orders[unit]
        order.extend(turns[sessions[heads[unit]]])
    return BatchPlan(order, planned)
