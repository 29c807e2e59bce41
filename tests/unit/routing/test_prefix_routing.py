"""Prefix views and prefix-aware routing: cached prefix vs load, bounded load, sticky keys, KV-event sync states."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    FrameProcessor,
    encode_frames,
)
from cpmemory.routing.prefix import (
    PENDING_CACHES,
    EventPrefixView,
    PromptBlocks,
    SentPrefixView,
    TeeHandler,
    text_blocks,
    token_blocks,
)
from cpmemory.routing.router import Router, RouterConfig, conversation_affinity_key

URLS = [f"http://r{i}" for i in range(4)]


def prompt(*keys: int, block_tokens: int = 10, total: int | None = None) -> PromptBlocks:
    return PromptBlocks(tuple(keys), block_tokens, total if total is not None else block_tokens * len(keys))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_text_blocks_share_leading_keys_exactly_when_prompts_share_a_prefix() -> None:
    history = [{"role": "system", "content": "s" * 600}, {"role": "user", "content": "u" * 900}]
    longer = text_blocks([*history, {"role": "assistant", "content": "a" * 700}], 256)
    shorter = text_blocks(history, 256)
    assert shorter.keys and longer.keys[: len(shorter.keys)] == shorter.keys
    other = text_blocks([{"role": "system", "content": "t" + "s" * 599}, history[1]], 256)
    assert not set(other.keys) & set(shorter.keys)  # chained: a different first chunk changes every key


def test_token_blocks_cut_full_blocks_only() -> None:
    blocks = token_blocks(list(range(50)), 16)
    assert len(blocks.keys) == 3 and blocks.total_tokens == 50
    assert token_blocks(list(range(40)), 16).keys == blocks.keys[:2]


def test_sent_view_evicts_tails_before_heads() -> None:
    view = SentPrefixView(1, capacity_tokens=40)
    view.record(0, prompt(1, 2, 3))
    view.record(0, prompt(7, 8))  # 50 tokens recorded: the oldest tail (3) goes first
    assert view.matched_blocks(0, prompt(1, 2, 3)) == 2
    assert view.matched_blocks(0, prompt(7, 8)) == 2
    assert view.utilisation(0) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=8), min_size=1, max_size=30),
       st.integers(0, 60))
def test_sent_view_stays_bounded_and_keeps_the_last_prompt_head(prompts: list[list[int]], capacity: int) -> None:
    view = SentPrefixView(1, capacity_tokens=capacity * 10)
    for raw in prompts:
        keys = tuple(dict.fromkeys(raw))  # a prompt never repeats a chained key
        view.record(0, prompt(*keys))
        assert view.utilisation(0) <= 1.0
        assert view.matched_blocks(0, prompt(*keys)) == min(len(keys), capacity)


def test_event_view_follows_stored_removed_and_cleared() -> None:
    view = EventPrefixView(2, [100, None])
    processor = FrameProcessor(view.handler(0))
    processor.process(encode_frames(EventBatch(1, 0.0, (BlockStored((11, 12, 13), None, tuple(range(6)), 2),))))
    assert view.matched_blocks(0, prompt(11, 12, 13, 14)) == 3 and view.matched_blocks(1, prompt(11)) == 0
    assert view.utilisation(0) == 0.03 and view.utilisation(1) == 0.0
    processor.process(encode_frames(EventBatch(2, 0.0, (BlockRemoved((12,)),))))
    assert view.matched_blocks(0, prompt(11, 12, 13)) == 1
    processor.process(encode_frames(EventBatch(3, 0.0, (AllBlocksCleared(),))))
    assert view.matched_blocks(0, prompt(11)) == 0 and view.synced(0)


def test_event_gap_drops_the_prefix_score_until_resync() -> None:
    clock = Clock()
    view = EventPrefixView(1, resync_after_s=30.0, clock=clock)
    processor = FrameProcessor(view.handler(0))
    stored = (BlockStored((1, 2), None, (0, 0, 0, 0), 2),)
    processor.process(encode_frames(EventBatch(5, 0.0, stored)))
    processor.process(encode_frames(EventBatch(9, 0.0, stored)))  # batches 6..8 lost
    assert processor.stats.gaps == 1 and view.stats(0).gaps == 1
    assert not view.synced(0) and view.matched_blocks(0, prompt(1, 2)) == 0  # load only
    clock.now = 29.0
    assert not view.synced(0)
    clock.now = 31.0
    assert view.synced(0) and view.matched_blocks(0, prompt(1, 2)) == 2  # what arrived after the gap is kept
    assert view.stats(0).resyncs == 1


def test_cleared_cache_resyncs_at_once_and_missing_events_unsync() -> None:
    clock = Clock()
    view = EventPrefixView(1, missing_after_s=10.0, clock=clock)
    view.gap(0)
    view.apply(0, EventBatch(1, 0.0, (AllBlocksCleared(),)))
    assert view.synced(0)
    view.record(0, prompt(5, 6))  # the view lacks these blocks: the replica must publish them
    clock.now = 5.0
    assert view.synced(0)
    clock.now = 11.0
    assert not view.synced(0) and view.stats(0).missing == 1
    view.apply(0, EventBatch(2, 0.0, (BlockStored((5, 6), None, (0, 0, 0, 0), 2),)))
    clock.now = 50.0  # events flow again and resync_after_s has passed
    assert view.synced(0)


def test_cached_prompt_sends_expect_no_event() -> None:
    clock = Clock()
    view = EventPrefixView(1, missing_after_s=1.0, clock=clock)
    view.apply(0, EventBatch(1, 0.0, (BlockStored((5, 6), None, (0, 0, 0, 0), 2),)))
    view.record(0, prompt(5, 6))  # fully cached: vLLM publishes nothing for a hit
    clock.now = 100.0
    assert view.synced(0)


def test_a_sent_prompt_is_pending_until_its_blocks_are_stored_or_its_time_is_up() -> None:
    """The engine stores a prompt's blocks only after its queue and prefill: until then the view counts them as
    pending on the replica it was sent to; the events decide once they come, and an unstored send expires."""
    clock = Clock()
    view = EventPrefixView(2, pending_s=60.0, missing_after_s=1_000.0, clock=clock)
    view.record(0, prompt(1, 2, 3))
    assert view.matched_blocks(0, prompt(1, 2, 9)) == 2 and view.matched_blocks(1, prompt(1, 2)) == 0
    view.apply(0, EventBatch(1, 0.0, (BlockStored((1, 2), None, (0, 0, 0, 0), 2),)))
    clock.now = 61.0  # block 3 was never stored: its pending time is up; 1 and 2 are the engine's now
    assert view.matched_blocks(0, prompt(1, 2, 3)) == 2
    view.apply(0, EventBatch(2, 0.0, (BlockRemoved((2,)),)))
    assert view.matched_blocks(0, prompt(1, 2, 3)) == 1
    view.record(0, prompt(7, 8))
    view.gap(0)  # lost events: nothing is trusted, pending included
    clock.now = 62.0
    assert view.matched_blocks(0, prompt(7, 8)) == 0
    view.apply(0, EventBatch(9, 0.0, (AllBlocksCleared(),)))
    assert view.synced(0) and view.matched_blocks(0, prompt(7, 8)) == 0


def test_pending_blocks_are_bounded_by_the_cache_the_most_recent_kept() -> None:
    """A queue much longer than the cache evicts the blocks sent first before a later prompt could reuse them: only
    the most recent ``PENDING_CACHES`` caches' worth of pending blocks count; stored blocks are the events' and stay."""
    assert PENDING_CACHES == 2  # the figures below: a 2-block cache keeps 4 pending blocks
    view = EventPrefixView(2, [2, None], missing_after_s=1_000.0)
    view.apply(0, EventBatch(1, 0.0, (BlockStored((1,), None, (0, 0, 0, 0), 1),)))
    view.record(0, prompt(1, 2, 3))  # 1 is stored: 2 and 3 pending
    view.record(0, prompt(5, 6, 7))  # five pending > 2 x 2: block 2 drops
    assert view.matched_blocks(0, prompt(1, 2, 3)) == 1
    assert view.matched_blocks(0, prompt(5, 6, 7)) == 3
    view.record(0, prompt(8, 9, 10, 11))
    assert view.matched_blocks(0, prompt(5, 6, 7)) == 0 and view.matched_blocks(0, prompt(8, 9, 10, 11)) == 4
    for replica_one in (prompt(1, 2, 3), prompt(5, 6, 7), prompt(8, 9, 10, 11)):  # capacity unknown: no bound
        view.record(1, replica_one)
    assert view.matched_blocks(1, prompt(1, 2, 3)) == 3


def test_tee_runs_every_handler_even_when_one_fails() -> None:
    seen: list[int] = []

    class Broken:
        def handle_batch(self, batch: EventBatch) -> None:
            raise RuntimeError("boom")

        def handle_gap(self, expected: int, received: int) -> None:
            raise RuntimeError("boom")

    class Recorder:
        def handle_batch(self, batch: EventBatch) -> None:
            seen.append(batch.sequence)

        def handle_gap(self, expected: int, received: int) -> None:
            seen.append(-received)

    processor = FrameProcessor(TeeHandler(Broken(), Recorder()))
    processor.process(encode_frames(EventBatch(1, 0.0, ())))
    processor.process(encode_frames(EventBatch(3, 0.0, ())))
    assert seen == [1, -3] and processor.stats.handler_errors == 2  # a failed gap skips that batch


def make_router(**config: object) -> tuple[Router, SentPrefixView]:
    view = SentPrefixView(len(URLS), 10_000)
    return Router(URLS, RouterConfig(**config), view=view), view


def test_prompt_goes_where_its_prefix_is_cached_not_where_rendezvous_points() -> None:
    router, view = make_router()
    key = "prefix|a"
    cached_on = next(i for i, url in enumerate(URLS) if url != router.ranking(key)[0])
    view.record(cached_on, prompt(1, 2, 3))
    decision = router.choose(key, prompt=prompt(1, 2, 3, 4))
    assert (decision.index, decision.reason, decision.cached_blocks) == (cached_on, "prefix", 3)
    assert router.choose(key, prompt=prompt(9)).reason == "cold"
    assert router.choose(key).url == router.ranking(key)[0]  # no prompt: rendezvous as before


def test_bounded_load_moves_a_prefix_off_an_overloaded_replica() -> None:
    router, view = make_router(load_factor=1.25, load_slack=2)
    view.record(2, prompt(1, 2))
    for _ in range(4):
        router.begin(URLS[2])
    decision = router.choose("k", prompt=prompt(1, 2, 3))
    # 4 in flight, all on replica 2: it would run 5 > 1.25 * 5 / 4 + 2 = 3.56
    assert decision.index != 2 and decision.reason == "load"
    for _ in range(3):
        router.end(URLS[2])
    # 1 in flight: 2 <= 1.25 * 2 / 4 + 2 = 2.63, the prefix wins again
    assert router.choose("k", prompt=prompt(1, 2, 3)).index == 2


def test_unsynced_replica_is_routed_by_load_only() -> None:
    view = EventPrefixView(2)
    router = Router(URLS[:2], view=view)
    view.apply(1, EventBatch(1, 0.0, (BlockStored((1, 2), None, (0, 0, 0, 0), 2),)))
    assert router.choose("k", prompt=prompt(1, 2)).index == 1
    view.gap(1)
    view.apply(1, EventBatch(3, 0.0, (BlockStored((1, 2), None, (0, 0, 0, 0), 2),)))
    decision = router.choose("k", prompt=prompt(1, 2))
    assert decision.reason == "cold" and decision.cached_blocks == 0


def test_sticky_keys_keep_their_replica_until_it_is_down_or_overloaded() -> None:
    router, view = make_router(balance_abs_threshold=2, balance_rel_threshold=1.5)
    key = conversation_affinity_key("t", "c")
    first = router.choose(key, prompt=prompt(1))
    router.record(key, first, prompt(1), sticky=True)
    view.record((first.index + 1) % 4, prompt(1, 2, 3))  # another replica holds a longer prefix of turn 2
    second = router.choose(key, prompt=prompt(1, 2, 3, 4), sticky=True)
    assert (second.index, second.reason) == (first.index, "affinity")
    assert router.choose(key, prompt=prompt(1, 2, 3, 4)).index != first.index  # not sticky: the prefix wins
    for _ in range(4):
        router.begin(URLS[first.index])
    assert router.choose(key, prompt=prompt(1, 2, 3, 4), sticky=True).reason in ("load", "prefix")
    router.mark_down(URLS[first.index])
    assert router.choose(key, prompt=prompt(9), sticky=True).reason == "failover"


def test_sticky_map_is_bounded() -> None:
    router, _ = make_router(sticky_keys=3)
    for i in range(10):
        router.record(f"k{i}", router.choose(f"k{i}", prompt=prompt(i)), prompt(i), sticky=True)
    assert len(router._sticky) == 3


def test_affinity_policy_ignores_the_prompt() -> None:
    router, view = make_router(policy="affinity")
    view.record(3, prompt(1, 2))
    assert router.choose("k", prompt=prompt(1, 2)).url == router.ranking("k")[0]


def test_grouped_prompts_stay_on_their_replica_and_load_stays_balanced() -> None:
    """Twelve prefix groups, requests arriving at random, 32 in flight: each group keeps to few replicas and the
    busiest replica serves at most 1.3x the mean."""
    router, _ = make_router()
    rng = random.Random(7)
    in_flight: list[str] = []
    served = [0] * len(URLS)
    homes: dict[int, set[int]] = {}
    for _ in range(3000):
        group = rng.randrange(12)
        blocks = prompt(group * 100, group * 100 + 1, rng.randrange(10**6))
        decision = router.choose(f"prefix|{rng.random()}", prompt=blocks)
        router.begin(decision.url)
        router.record("x", decision, blocks)
        in_flight.append(decision.url)
        if len(in_flight) > 32:
            router.end(in_flight.pop(0))
        served[decision.index] += 1
        homes.setdefault(group, set()).add(decision.index)
    assert max(served) <= 1.3 * sum(served) / len(served)
    assert sum(len(replicas) for replicas in homes.values()) / len(homes) < 2.5


def test_a_sticky_key_keeps_its_replica_when_the_prompt_could_not_be_tokenized() -> None:
    router, _view = make_router(balance_abs_threshold=2, balance_rel_threshold=1.5)
    key = next(f"conversation-{n}" for n in range(50) if router.ranking(f"conversation-{n}")[0] != URLS[2])
    router.record(key, router.choose(key, prompt=prompt(1)), prompt(1), sticky=True)
    router._sticky[key] = 2  # the conversation lives on replica 2, not on its rendezvous first choice
    assert router.sticky_replica(key) == 2
    decision = router.choose(key, prompt=None, sticky=True)
    assert (decision.index, decision.reason) == (2, "affinity")
    assert router.choose(key, prompt=None).url == router.ranking(key)[0]  # not sticky: the key decides
    for _ in range(4):
        router.begin(URLS[2])
    assert router.sticky_replica(key) is None  # overloaded: the caller must give a prompt to score
    assert router.choose(key, prompt=None, sticky=True).index != 2
    router.end(URLS[2])
    router.end(URLS[2])
    router.end(URLS[2])
    router.end(URLS[2])
    router.mark_down(URLS[2])
    assert router.sticky_replica(key) is None
    lost = router.choose(key, prompt=None, sticky=True)
    assert lost.index != 2 and lost.reason == "failover"
    assert make_router()[0].sticky_replica("never-seen") is None
    assert make_router(policy="affinity")[0].sticky_replica(key) is None
