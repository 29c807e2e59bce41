"""Scheduling (paper Algorithm 5): run requests that share a prefix back to back.

Requests are grouped by the first element of their search path (the top-level subtree they fall in); inside a
group the longest paths (deepest, most specific prefixes) go first; groups go largest first. Ties keep the input
order, so the result is deterministic. Requests with an empty path (nothing shared) form one group.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["schedule"]


def schedule(search_paths: Sequence[Sequence[int]]) -> list[int]:
    """Return the execution order: indices into ``search_paths``. Pure, O(N log N)."""
    groups: dict[int | None, list[int]] = {}
    for position, path in enumerate(search_paths):
        groups.setdefault(path[0] if len(path) else None, []).append(position)
    ordered_groups = sorted(groups.values(), key=len, reverse=True)  # stable: first-seen group wins a tie
    order: list[int] = []
    for members in ordered_groups:
        order.extend(sorted(members, key=lambda position: len(search_paths[position]), reverse=True))
    return order
