"""Bounded transcripts (issue 13): the in-memory store and the Redis scripts (fakeredis) trim alike, and a seen entry
always points into a stored turn."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmemory.core.blocks import content_hash, label_for_hash
from cpmemory.stores.memory import InMemorySessionStore
from cpmemory.stores.redis_store import RedisSessionStore, RedisStoreConfig
from cpmemory.types import ConversationKey, ReserveRequest, SeenBlock, TurnRecord

fakeredis = pytest.importorskip("fakeredis")
pytest.importorskip("lupa")

TURN = st.tuples(
    st.lists(st.integers(0, 7), max_size=4, unique=True),  # which of 8 texts the turn shows (under id "b<i>")
    st.integers(0, 12),  # trim_before
    st.booleans(),  # the id of block 0 now carries another text (a changed block)
)


def _record(turn: int, shown: list[int], trim_before: int, changed: bool) -> TurnRecord:
    blocks = []
    for i in shown:
        text = f"text {i}" + (" v2" if changed and i == 0 else "")
        digest = content_hash(text)
        blocks.append(SeenBlock(f"b{i}", digest, label_for_hash(digest), 0))
    messages = ({"role": "user", "content": f"u{turn}"}, {"role": "assistant", "content": f"a{turn}"})
    return TurnRecord(messages, tuple(blocks), (turn,), trim_before)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(TURN, min_size=1, max_size=14), cap=st.integers(1, 6), window=st.sampled_from([None, 2, 3]))
def test_memory_and_redis_trim_alike(turns: list, cap: int, window: int | None) -> None:
    memory = InMemorySessionStore(max_transcript_turns=cap)
    redis_store = RedisSessionStore(fakeredis.FakeRedis(), RedisStoreConfig(prefix=f"p{uuid.uuid4().hex[:8]}",
                                                                            max_transcript_turns=cap))
    key = ConversationKey("t", "c")
    history: list[list[tuple[str, str]]] = []  # (id, hash) shown per committed turn
    every = tuple((f"b{i}", content_hash(f"text {i}")) for i in range(8)) + (("b0", content_hash("text 0 v2")),)
    for number, (shown, trim_before, changed) in enumerate(turns, start=1):
        record = _record(number, shown, trim_before, changed)
        history.append([(b.block_id, b.content_hash) for b in record.shown])
        for store in (memory, redis_store):
            reservation = store.reserve(key, ReserveRequest(blocks=()))
            assert store.commit(key, reservation.reservation_id, _record(number, shown, trim_before, changed)) == number
        states = [store.load(key) for store in (memory, redis_store)]
        assert states[0].transcript == states[1].transcript and states[0].search_paths == states[1].search_paths
        assert dict(states[0].seen) == dict(states[1].seen) and dict(states[0].ids) == dict(states[1].ids)
        stored = len(states[0].search_paths)
        assert 1 <= stored <= cap and stored <= number - min(trim_before, number - 1)
        kept = history[number - stored :]  # the stored turns' shown blocks, oldest first
        last_showing = {h: (block, number - stored + 1 + i) for i, pairs in enumerate(kept) for block, h in pairs}
        assert {h: (s.block_id, s.turn) for h, s in states[0].seen.items()} == last_showing
        assert set(states[0].ids.items()) <= {pair for pairs in kept for pair in pairs}
        reads = [store.reserve(key, ReserveRequest(blocks=every, history_turns=window)) for store in (memory, redis_store)]
        assert reads[0].transcript == reads[1].transcript and reads[0].transcript_start == reads[1].transcript_start
        assert reads[0].turn_sizes == reads[1].turn_sizes and dict(reads[0].seen) == dict(reads[1].seen)
        for read, store in zip(reads, (memory, redis_store)):
            store.abort(key, read.reservation_id)
