"""No stale decision is trusted after a gap: the shared decision state on its own redis-server, saved, killed and
restarted with its data (the orders recorded before the outage survive it, as with persistence or a partition).

Orders are forced with ``prompt_order`` (a conversation's first turn records the order it sent), so what the shared
state would decide is known: blocks a, b, c recorded as c, a, b; the orderer's own choice for a fresh trie is
a, b, c (the largest block first).
"""
from __future__ import annotations

import pytest
import redis

from cpmemory.facade import CpMemory
from cpmemory.stores.redis_store import RedisSessionStore, RedisStoreConfig
from cpmemory.testing.local_redis import LocalRedisServer, redis_binaries_available

pytestmark = pytest.mark.skipif(not redis_binaries_available(), reason="redis-server / redis-cli not on PATH")

BLOCKS = [{"id": name, "text": f"Block {name}. " + "words " * size} for name, size in (("a", 90), ("b", 60), ("c", 30))]
FRESH = ["a", "b", "c"]  # the extension order (size x odds) of a trie that holds nothing trusted


def _facade(url: str) -> CpMemory:
    config = RedisStoreConfig(prefix="gap", socket_timeout_s=0.3, connect_timeout_s=0.3, retries=0)
    return CpMemory(store=RedisSessionStore.from_url(url, config))


def _record(memory: CpMemory, conversation: str, order: list[str]) -> None:
    turn = memory.prepare(conversation, "q", BLOCKS, prompt_order=order)
    assert turn.prompt_order == order and not turn.degraded
    memory.commit(turn, "answer")


def _decided(memory: CpMemory, conversation: str) -> list[str]:
    turn = memory.prepare(conversation, "q", BLOCKS)
    assert not turn.degraded
    memory.commit(turn, "answer")
    return turn.prompt_order


def test_orders_recorded_before_an_outage_are_not_trusted_after_it() -> None:
    with LocalRedisServer() as server:
        first, idle = _facade(server.url), _facade(server.url)
        _record(first, "before", ["c", "a", "b"])
        assert _decided(idle, "shared") == ["c", "a", "b"]  # the shared state decides for every worker
        redis.Redis.from_url(server.url).save()

        server.kill()
        during = first.prepare("during", "q", BLOCKS)
        assert during.degraded and during.prompt_order == FRESH  # pass-through, relevance order
        late = _facade(server.url)  # a third worker that also fails during the outage
        assert late.prepare("late-during", "q", BLOCKS).degraded

        server.start()  # the same data, loaded from the dump: the trie still holds c, a, b
        assert redis.Redis.from_url(server.url).dbsize() > 0
        assert _decided(first, "after") == FRESH  # the first worker back distrusts the pre-gap trie
        assert _decided(idle, "idle-after") == FRESH  # so does a worker that saw no failure (shared)
        _record(first, "fresh", ["b", "c", "a"])  # recorded after the gap: trusted
        assert _decided(late, "late-after") == ["b", "c", "a"]  # one outage is one gap: no second distrust


def test_a_cleared_engine_cache_distrusts_the_shared_trie() -> None:
    with LocalRedisServer() as server:
        first, other = _facade(server.url), _facade(server.url)
        _record(first, "before", ["c", "a", "b"])
        assert _decided(other, "shared") == ["c", "a", "b"]
        first.reset_index()  # AllBlocksCleared (or an event gap) seen by this worker: no IO now
        assert _decided(first, "after-reset") == FRESH
        assert _decided(other, "other-after-reset") == FRESH
        first.reset_index("default")  # one tenant: distrusted at its next call, at once
        _record(other, "fresh", ["b", "c", "a"])
        assert _decided(first, "after-tenant-reset") == FRESH
