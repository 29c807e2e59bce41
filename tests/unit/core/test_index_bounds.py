"""The index's request map stays bounded when the same block set keeps coming back."""
from __future__ import annotations

from cpmemory.core.index import ContextIndex


def test_repeated_contexts_keep_only_the_newest_request_ids_per_leaf():
    index = ContextIndex()
    index.max_requests_per_leaf = 4
    dropped: list[str] = []
    for number in range(20):
        dropped.extend(index.insert(["a", "b", "c"], f"r{number}").evicted)
    assert len(index) == 4
    assert dropped == [f"r{number}" for number in range(16)]
    assert index.lookup("r19") is not None and not index.evict("r0")
    index.check_integrity()
    for number in range(16, 20):
        assert index.evict(f"r{number}")
    assert len(index) == 0
    index.check_integrity()
