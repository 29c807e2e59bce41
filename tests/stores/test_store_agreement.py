"""Issue 16: the stores agree on repeated commits long after, and many stores share one client's pool."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cpmemory.errors import UnknownReservationError
from cpmemory.stores.base import FINISHED_MARKERS_KEPT, ConversationKey, ReserveRequest
from tests.stores.test_contract import Awaiting, blocks, conversation, make_store, mode, record, store  # noqa: F401

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


@pytest.mark.redis
def test_many_stores_on_one_client_do_not_run_its_pool_dry(real_redis: str, run_prefix: str) -> None:
    import redis

    from cpmemory.stores.redis_store import RedisSessionStore, RedisStoreConfig

    client: Any = redis.Redis.from_url(real_redis, max_connections=8)
    stores = [RedisSessionStore(client, RedisStoreConfig(prefix=run_prefix)) for _ in range(100)]
    key = ConversationKey("tenant", "pool")
    for store in stores:
        reservation = store.reserve(key, ReserveRequest(blocks=()))
        store.abort(key, reservation.reservation_id)
    assert stores[0].load(key).open_reservations == 0
    stores[0].delete(key)
    client.close()
