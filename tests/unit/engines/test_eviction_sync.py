"""EvictionSync: KV events from the mock engine keep the facade's index in step with the engine's cache."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory import CpMemory
from cpmemory.engines.block_hashes import BlockHasher
from cpmemory.engines.client import EngineClient
from cpmemory.engines.eviction_sync import EvictionSync
from cpmemory.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    FrameProcessor,
    encode_frames,
)
from cpmemory.testing.mock_engine import MockEngine

DOCUMENTS = [{"id": f"doc-{n}", "text": f"Document {n}: " + f"fact {n}. " * 3} for n in range(8)]


class Harness:
    """A facade, a mock engine whose KV events feed an EvictionSync, and a client; runs turns end to end."""

    def __init__(self, capacity_blocks: int, server_seed: str = "vllm-none-hash") -> None:
        self.memory = CpMemory()
        self.engine = MockEngine(block_size=16, capacity_blocks=capacity_blocks)
        self.engine.hasher = BlockHasher(16, none_hash_seed=server_seed)
        self.client = EngineClient("http://mock", transport=self.engine.transport())
        self.sync = EvictionSync.for_engine(self.memory, self.client)
        self.processor = FrameProcessor(self.sync)
        self.engine.listener = self.processor.process
        self.prompts: dict[str, tuple[str, list[int], int, str | None]] = {}

    def turn(self, conversation: str, documents: list[int], tenant: str = "default",
             salt: str | None = None) -> str:
        blocks = [DOCUMENTS[n] for n in documents]
        prepared = self.memory.prepare(conversation, f"question about {documents}?", blocks, tenant=tenant)
        tokens = self.client.tokenize(prepared.messages)
        if prepared.request_id:  # "" when the turn added no leaf (every block already shown)
            self.sync.register(prepared.request_id, tokens, tenant=tenant, cache_salt=salt)
            self.prompts[prepared.request_id] = (tenant, tokens, len(self.engine.batches), salt)
        self.client.chat(prepared.messages, request_id=prepared.request_id, cache_salt=salt, max_tokens=1)
        self.memory.commit(prepared, "ok")
        return prepared.request_id

    def expected_evicted(self) -> set[str]:
        """Requests with a block removed by the engine after they were registered (from the raw event log)."""
        evicted = set()
        for request_id, (_tenant, tokens, registered_at, salt) in self.prompts.items():
            needed = set(self.engine.hasher.hashes(tokens, cache_salt=salt))
            for batch in self.engine.batches[registered_at:]:
                for event in batch.events:
                    if isinstance(event, BlockRemoved) and needed & set(event.block_hashes):
                        evicted.add(request_id)
        return evicted

    def index_sizes(self) -> int:
        return sum(self.memory.index_size(tenant) for tenant in {t for t, *_ in self.prompts.values()})


def test_evictions_follow_the_engine_exactly():
    harness = Harness(capacity_blocks=40)
    for step in range(12):
        harness.turn(f"conversation-{step}", [step % 8, (step * 3 + 1) % 8])
    expected = harness.expected_evicted()
    assert expected, "the workload must overflow the cache"
    tracked = set(harness.prompts) - expected
    assert harness.sync.tracked_requests() == len(tracked)
    assert harness.memory.index_size() == len(tracked)
    cached = set(harness.engine.cached_blocks())
    for request_id in tracked:  # whatever the index still holds is really cached
        _tenant, tokens, _at, _salt = harness.prompts[request_id]
        assert set(harness.engine.hasher.hashes(tokens)) <= cached
    assert harness.sync.stats.hash_mismatches == 0 and harness.sync.stats.hash_matches > 0
    assert harness.processor.stats.malformed_frames == 0


@settings(max_examples=30, deadline=None)
@given(workload=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 7), min_size=1, max_size=3,
                                                                 unique=True)), min_size=1, max_size=10),
       capacity=st.integers(20, 60), mismatched_seed=st.booleans())
def test_index_never_holds_a_request_whose_prefix_was_evicted(workload, capacity, mismatched_seed):
    harness = Harness(capacity, server_seed="another-seed" if mismatched_seed else "vllm-none-hash")
    for conversation, documents in workload:
        harness.turn(f"c{conversation}", documents)
        expected_tracked = set(harness.prompts) - harness.expected_evicted()
        assert harness.sync.tracked_requests() == len(expected_tracked)
        assert harness.memory.index_size() == len(expected_tracked)
    if mismatched_seed:
        assert harness.sync.stats.hash_matches == 0  # every hash went through the BlockStored translation


def test_tenants_with_cache_salts_are_evicted_in_their_own_index():
    harness = Harness(capacity_blocks=48)  # a prompt here is about 21 blocks: two fit, a third evicts
    first = harness.turn("a", [0, 1], tenant="tenant-a", salt="salt-a")
    harness.turn("b", [0, 1], tenant="tenant-b", salt="salt-b")
    assert harness.memory.index_size("tenant-a") == 1 and harness.memory.index_size("tenant-b") == 1
    for step in range(6):
        harness.turn(f"b{step}", [2 + step % 6, (3 + step) % 8], tenant="tenant-b", salt="salt-b")
    expected = harness.expected_evicted()
    assert first in expected
    assert harness.memory.index_size("tenant-a") == 0
    survivors_b = {r for r, (t, *_rest) in harness.prompts.items() if t == "tenant-b"} - expected
    assert harness.memory.index_size("tenant-b") == len(survivors_b)


def test_all_blocks_cleared_resets_index_and_mapping():
    harness = Harness(capacity_blocks=200)
    for step in range(3):
        harness.turn(f"c{step}", [step])
    assert harness.memory.index_size() == 3
    harness.client.reset_prefix_cache()
    assert harness.memory.index_size() == 0
    assert harness.sync.tracked_requests() == 0
    assert harness.sync.stats.resets == 1
    harness.turn("after", [4])
    assert harness.memory.index_size() == 1


def test_sequence_gap_resets_instead_of_keeping_a_wrong_index():
    harness = Harness(capacity_blocks=200)
    harness.turn("c", [0])
    lost_sequence = len(harness.engine.batches)
    harness.engine.listener = None  # the next batch is lost on the way
    harness.turn("d", [1])
    harness.engine.listener = harness.processor.process
    assert harness.memory.index_size() == 2
    harness.turn("e", [2])  # its batch reveals the gap
    assert harness.processor.stats.gaps == 1 and harness.sync.stats.resyncs == 1
    assert harness.engine.batches[lost_sequence].sequence == lost_sequence
    assert harness.memory.index_size() == 0


def test_report_evicted_uses_registered_tenants():
    harness = Harness(capacity_blocks=200)
    first = harness.turn("a", [0], tenant="tenant-a")
    second = harness.turn("b", [1], tenant="tenant-b")
    assert harness.sync.report_evicted([first, second, "never-seen"]) == 2
    assert harness.memory.index_size("tenant-a") == 0 and harness.memory.index_size("tenant-b") == 0
    assert harness.sync.tracked_requests() == 0
    assert harness.sync.stats.reported_requests == 3


class FailingTarget:
    """A facade stand-in whose evict and reset fail (a store outage)."""

    def evict(self, request_ids, *, tenant="default"):
        raise RuntimeError("store down")

    def reset_index(self, tenant=None):
        raise RuntimeError("store down")


def test_target_failures_are_counted_not_raised_and_unknown_hashes_ignored():
    sync = EvictionSync(FailingTarget(), BlockHasher(4))
    hashes = sync.register("r1", list(range(8)))
    processor = FrameProcessor(sync)
    processor.process(encode_frames(EventBatch(0, 0.0, (BlockRemoved((12345,), "GPU"),))))
    assert sync.stats.unknown_removed_blocks == 1 and sync.tracked_requests() == 1
    processor.process(encode_frames(EventBatch(1, 0.0, (BlockRemoved((hashes[1],), "GPU"),))))
    processor.process(encode_frames(EventBatch(2, 0.0, (AllBlocksCleared(),))))
    assert sync.stats.target_errors == 2
    assert sync.tracked_requests() == 0
    assert processor.stats.handler_errors == 0


def test_stored_block_with_unknown_parent_is_assumed_exact():
    sync = EvictionSync(CpMemory(), BlockHasher(4))
    hashes = sync.register("r1", list(range(8)))
    sync.handle_batch(EventBatch(0, 0.0, (BlockStored((hashes[1],), 999, (4, 5, 6, 7), 4, None, "GPU"),)))
    assert sync.stats.hash_matches == 0 and sync.stats.hash_mismatches == 0
    assert sync.requests_for(hashes[1]) == {"r1"}
    sync.register("r1", list(range(100, 104)))  # re-registering replaces the prompt
    assert sync.requests_for(hashes[1]) == set()
    assert sync.forget("r1") and not sync.forget("r1")


def test_registrations_are_bounded():
    sync = EvictionSync(CpMemory(), BlockHasher(4), max_tracked_requests=2)
    first = sync.register("r1", [1, 2, 3, 4])
    sync.register("r2", [5, 6, 7, 8])
    sync.register("r3", [9, 10, 11, 12])
    assert sync.tracked_requests() == 2 and sync.stats.dropped_registrations == 1
    assert sync.requests_for(first[0]) == set()


def test_unreproducible_server_algorithm_falls_back_to_translation():
    from types import SimpleNamespace

    from cpmemory.engines.client import CacheConfig

    engine = SimpleNamespace(cache_config=lambda: CacheConfig(16, "xxhash", True, None))
    sync = EvictionSync.for_engine(CpMemory(), engine)
    assert sync.hasher.algorithm == "sha256" and sync.hasher.block_size == 16
    hashes = sync.register("r1", list(range(32)))
    server_hashes = (111, 222)  # what an xxhash server would publish for the same two blocks
    sync.handle_batch(EventBatch(0, 0.0, (BlockStored(server_hashes, None, tuple(range(32)), 16, None, "GPU"),)))
    assert sync.stats.hash_mismatches == 2
    assert sync.requests_for(222) == {"r1"} and sync.requests_for(hashes[1]) == {"r1"}
    sync.handle_batch(EventBatch(1, 0.0, (BlockRemoved((222,), "GPU"),)))
    assert sync.tracked_requests() == 0 and sync.stats.evicted_requests == 1
