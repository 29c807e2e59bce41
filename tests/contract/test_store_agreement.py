"""Issue 16: the stores agree on repeated commits long after, and many stores share one client's pool."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cpmemory.errors import UnknownReservationError
from cpmemory.stores.base import FINISHED_MARKERS_KEPT, ReserveRequest
from tests.contract.test_store_contract import Awaiting, blocks, conversation, make_store, mode, record, store  # noqa: F401

LUA = Path(__file__).resolve().parents[2] / "cpmemory" / "stores" / "lua" / "common.lua"


def test_lua_keeps_as_many_finished_ids_as_the_in_memory_store() -> None:
    from cpmemory.stores.memory import MAX_FINISHED_MARKERS

    kept = int(re.search(r"local DONE_KEEP = (\d+)", LUA.read_text()).group(1))
    assert kept == FINISHED_MARKERS_KEPT == MAX_FINISHED_MARKERS


@pytest.mark.parametrize("later", [FINISHED_MARKERS_KEPT - 1, FINISHED_MARKERS_KEPT + 44])
async def test_repeated_commit_after_many_later_commits(store: Awaiting, later: int) -> None:
    key = conversation()
    pairs = blocks("a")
    first = await store.reserve(key, ReserveRequest(blocks=pairs))
    assert await store.commit(key, first.reservation_id, record(pairs)) == 1
    for _ in range(later):
        reservation = await store.reserve(key, ReserveRequest(blocks=()))
        await store.commit(key, reservation.reservation_id, record(()))
    if later < FINISHED_MARKERS_KEPT:
        assert await store.commit(key, first.reservation_id, record(pairs)) == 1
    else:
        with pytest.raises(UnknownReservationError):
            await store.commit(key, first.reservation_id, record(pairs))
    assert (await store.load(key)).turns == later + 1
