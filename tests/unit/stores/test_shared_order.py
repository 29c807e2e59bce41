"""``SharedOrder``: the order completed in the worker from the counts ``decide.lua`` returns is the Python
orderer's, for the whole request and for the blocks a turn shows (a subset)."""
from __future__ import annotations

import random
import struct

import pytest

from cpmemory.core.online import OnlineOrderer
from cpmemory.stores.decisions import SharedOrder


def _packed(orderer: OnlineOrderer, key: str) -> bytes:
    """The freq value decide.lua keeps for ``key``: count, first ordinal, posting (ordinals modulo 2^32)."""
    posting = orderer._postings[key]
    return (orderer._frequency[key].to_bytes(6, "big") + orderer._first_seen[key].to_bytes(6, "big")
            + struct.pack(f">{len(posting)}I", *(ordinal % 2**32 for ordinal in posting)))


@pytest.mark.parametrize("seed", range(6))
def test_the_shared_order_of_any_subset_is_the_python_orderer_s(seed):
    rng = random.Random(seed)
    keys = [f"k{i:02d}" for i in range(14)]
    orderer = OnlineOrderer()
    for _ in range(rng.randint(5, 300)):
        orderer.observe(rng.sample(keys, rng.randint(1, 7)))
    request = rng.sample(keys, 9)
    own = orderer.observe(request)
    sizes = {key: float(rng.randint(1, 40)) for key in request}
    matched = tuple(request[:rng.randint(0, 3)])
    shared = SharedOrder(matched, {key: _packed(orderer, key) for key in request}, sizes, own)
    for subset in (request, request[2:7], request[4:6], [request[-1]]):
        path = [key for key in matched if key in subset]
        rest = [key for key in subset if key not in path]
        assert shared.order(subset) == path + orderer._extension(rest, sizes, path, own)
