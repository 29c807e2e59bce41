"""The fleet view's contract (cpmemory.routing.fleet): what a replica's record says it holds, whatever feeds it.

One set of behaviour tests runs against the record fed by what was sent (``sent``: the router's
``SentPrefixView``), fed by the in-process mock engine's KV events (``mock-events``: ``EventPrefixView`` through the
same frame decoding as the proxy's subscribers) and (marker ``vllm``, ``CPM_VLLM_URL`` and ``CPM_VLLM_KV_ENDPOINT``
from ``.ci/vllm.env``) fed by a real vLLM's KV events over ZMQ. Every prompt is tokenized and hashed as the engine
does (its ``/tokenize``, its block size and hash algorithm), so the block keys are the engine's own.
"""
from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.online import OnlineOrderer
from cpmemory.engines.block_hashes import BlockHasher
from cpmemory.engines.client import AsyncEngineClient, EngineSettings
from cpmemory.engines.kv_events import FrameProcessor
from cpmemory.routing.fleet import FleetView
from cpmemory.routing.prefix import EventPrefixView, PromptBlocks, SentPrefixView, engine_blocks, text_blocks
from cpmemory.routing.router import Router
from cpmemory.testing.mock_engine import MockEngine

BLOCK = 16
CAPACITY_BLOCKS = 24
EVENTS_POLLS = 1200  # of EVENTS_POLL_S: a real vLLM publishes once it has prefilled (the mock: before it answers)
EVENTS_POLL_S = 0.05


@dataclass
class Feed:
    """A fleet of two replicas whose replica 0 is an engine, and how its record is fed."""

    name: str
    fleet: FleetView
    client: AsyncEngineClient
    hasher: BlockHasher
    capacity_tokens: int | None  # None: too large to fill in a test (a real vLLM)
    events: EventPrefixView | None = None
    cleanup: list[Callable[[], Any]] = field(default_factory=list)
    flushed: PromptBlocks | None = None  # the prompt a reset ran to have a real engine publish its events

    def words(self, count: int) -> int:
        """``count`` words at the mock's block size, as many more as the engine's blocks are larger (a real vLLM on
        the CPU keeps 128 tokens a block), so a prompt spans the same number of blocks on every feed."""
        return count * max(1, self.hasher.block_size // BLOCK)

    async def blocks(self, messages: list[dict[str, str]]) -> PromptBlocks:
        return engine_blocks(await self.client.tokenize(messages), self.hasher)

    async def send(self, messages: list[dict[str, str]]) -> PromptBlocks:
        """Route ``messages`` to replica 0 (the fleet records it), run them there, and wait for its events."""
        prompt = await self.blocks(messages)
        stored = 0 if self.events is None else self.events.stats(0).stored_blocks
        self.fleet.send(0, prompt)
        await self.client.chat(messages, max_tokens=1)
        if self.events is not None and prompt.keys:
            await _until(lambda: self.events is not None and self.events.stats(0).stored_blocks > stored)
        return prompt

    async def reset(self) -> bool:
        """Empty replica 0's cache; False where the engine refuses (a vLLM without dev mode)."""
        clears = 0 if self.events is None else self.events.stats(0).clears
        if not await self.client.reset_prefix_cache():
            return False
        if self.events is None:
            self.fleet.clear(0)  # what the proxy does when it learns an engine restarted
        else:
            if self.name == "vllm":  # a real vLLM publishes per engine step: run one (it may store the chat's head)
                flush = _messages(_fresh(4))
                self.flushed = await self.blocks(flush)
                await self.client.chat(flush, max_tokens=1)
            await _until(lambda: self.events is not None and self.events.stats(0).clears > clears)
        return True


async def _until(condition: Callable[[], bool]) -> None:
    """Wait for events published from another thread or process (at once for the mock, whose listener is
    synchronous)."""
    for _ in range(EVENTS_POLLS):
        if condition():
            return
        await asyncio.sleep(EVENTS_POLL_S)


def _mock(listener: Callable[[list[bytes]], Any] | None = None) -> tuple[MockEngine, AsyncEngineClient]:
    engine = MockEngine(block_size=BLOCK, capacity_blocks=CAPACITY_BLOCKS, listener=listener)
    return engine, AsyncEngineClient("http://mock", transport=engine.transport())


async def _vllm_feed() -> Feed:
    url, endpoint = os.environ.get("CPM_VLLM_URL"), os.environ.get("CPM_VLLM_KV_ENDPOINT")
    if not (url and endpoint):
        pytest.skip("CPM_VLLM_URL and CPM_VLLM_KV_ENDPOINT not set (start the CI servers with .ci/vllm.sh ci-up; "
                    "source .ci/vllm.env)")
    from cpmemory.engines.kv_events import KVEventSubscriber

    client = AsyncEngineClient(EngineSettings(base_url=url, timeout_s=120))
    config = await client.cache_config()
    events = EventPrefixView(2, [config.num_blocks, None], pending_s=0.0)
    subscriber = KVEventSubscriber(endpoint, events.handler(0)).start()
    fleet = FleetView(2, events)
    return Feed("vllm", fleet, client, BlockHasher(config.block_size, config.hash_algorithm), None, events,
                [subscriber.stop])


@pytest.fixture(params=["sent", "mock-events", pytest.param("vllm", marks=pytest.mark.vllm)])
async def feed(request) -> AsyncIterator[Feed]:
    if request.param == "sent":
        _, client = _mock()
        fleet = FleetView(2, SentPrefixView(2, CAPACITY_BLOCKS * BLOCK))
        made = Feed("sent", fleet, client, BlockHasher(BLOCK), CAPACITY_BLOCKS * BLOCK)
    elif request.param == "mock-events":
        # pending_s=0: only what the engine reported stored counts, so these tests read the events, not the sends
        events = EventPrefixView(2, [CAPACITY_BLOCKS, CAPACITY_BLOCKS], pending_s=0.0)
        processor = FrameProcessor(events.handler(0))
        engine, client = _mock(processor.process)
        made = Feed("mock-events", FleetView(2, events), client, engine.hasher, CAPACITY_BLOCKS * BLOCK, events)
    else:
        made = await _vllm_feed()
    try:
        yield made
    finally:
        for stop in made.cleanup:
            stop()
        await made.client.aclose()


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _common(one: PromptBlocks, other: PromptBlocks) -> int:
    """Leading block keys two prompts share."""
    shared = 0
    while shared < min(len(one.keys), len(other.keys)) and one.keys[shared] == other.keys[shared]:
        shared += 1
    return shared


def _fresh(words: int) -> str:
    """A text no earlier run cached (a real engine keeps its cache between runs)."""
    stamp = uuid.uuid4().hex
    return " ".join(f"{stamp[:8]}-{index}" for index in range(words))


async def test_a_sent_prompt_is_held_on_its_replica_in_tokens_and_nowhere_else(feed: Feed) -> None:
    prompt = await feed.send(_messages(_fresh(feed.words(20))))
    assert len(prompt.keys) >= 2
    full = len(prompt.keys) * prompt.block_tokens
    assert feed.fleet.cached_tokens(0, prompt) == full
    assert feed.fleet.cached_tokens(1, prompt) == 0
    assert 0.0 < feed.fleet.utilisation(0) <= 1.0 or feed.capacity_tokens is None


async def test_a_prompt_that_extends_a_sent_one_finds_its_shared_blocks(feed: Feed) -> None:
    first = _messages(_fresh(feed.words(20)))
    sent = await feed.send(first)
    longer = await feed.blocks(first + [{"role": "assistant", "content": "ok"},
                                        {"role": "user", "content": _fresh(feed.words(12))}])
    other = await feed.blocks(_messages(_fresh(feed.words(20))))
    shared, chat_head = _common(sent, longer), _common(sent, other)  # the chat template's head is shared by all
    assert shared > chat_head + 1
    assert feed.fleet.cached_tokens(0, longer) == shared * longer.block_tokens
    assert feed.fleet.cached_tokens(0, other) == chat_head * other.block_tokens


async def test_an_emptied_cache_holds_nothing(feed: Feed) -> None:
    prompt = await feed.send(_messages(_fresh(feed.words(20))))
    assert feed.fleet.cached_tokens(0, prompt) > 0
    if not await feed.reset():
        pytest.skip(f"{feed.name}: the engine refuses to reset its prefix cache (vLLM outside dev mode)")
    head = 0 if feed.flushed is None else _common(prompt, feed.flushed)  # at most the chat template's head
    assert head <= 1 and feed.fleet.cached_tokens(0, prompt) == head * prompt.block_tokens


async def test_the_record_is_bounded_by_the_replica_s_cache(feed: Feed) -> None:
    if feed.capacity_tokens is None:
        pytest.skip(f"{feed.name}: the cache is too large to fill in a test")
    prompts = [await feed.send(_messages(_fresh(feed.words(10)))) for _ in range(6)]  # more blocks than the cache holds
    assert sum(len(prompt.keys) for prompt in prompts) > CAPACITY_BLOCKS
    last, first = prompts[-1], prompts[0]
    assert feed.fleet.cached_tokens(0, last) == len(last.keys) * last.block_tokens  # the newest is held whole
    assert feed.fleet.cached_tokens(0, first) < len(first.keys) * first.block_tokens  # the oldest lost blocks
    assert feed.fleet.utilisation(0) <= 1.0
    held = {key for prompt in prompts
            for key in prompt.keys[:feed.fleet.cached_tokens(0, prompt) // prompt.block_tokens]}
    assert len(held) * BLOCK <= feed.capacity_tokens


def test_the_records_count_requests_and_the_pick_s_tokens_per_replica() -> None:
    fleet = FleetView(2)
    fleet.begin(0)
    fleet.begin(0)
    fleet.end(0)
    fleet.picked(1, 300)
    fleet.picked(1, 200)
    fleet.unpicked(1, 300)
    fleet.end(1)  # an end without a begin never goes below zero
    zero, one = fleet.records
    assert (zero.in_flight, zero.requests, zero.picked) == (1, 2, 0)
    assert (one.in_flight, one.requests, one.picked, one.picked_tokens) == (0, 0, 1, 200)


def test_block_orders_are_held_in_tokens_at_the_calibration_and_bounded_by_the_capacity() -> None:
    ratio = [0.5]
    fleet = FleetView(1, capacity_tokens=lambda replica: 100, tokens_per_char=lambda: ratio[0], follow_orders=True)
    fleet.send_order(0, ["a", "b"], [60, 60])
    assert fleet.cached_order(0, ["a", "b"]) == 60.0  # 120 characters at half a token each
    fleet.send_order(0, ["c", "d"], [60, 60])  # 60 more tokens where 100 fit: the oldest tail goes first
    assert fleet.order_tokens(0) <= 100
    assert fleet.cached_order(0, ["c", "d"]) == 60.0 and fleet.cached_order(0, ["a", "b"]) == 30.0
    fleet.clear(0)
    assert fleet.cached_order(0, ["c"]) == 0.0 and fleet.order_tokens(0) == 0.0
    quiet = FleetView(1)
    quiet.send_order(0, ["a"], [60])  # not followed unless the pick reads it
    assert quiet.cached_order(0, ["a"]) == 0.0


SIZES = {key: float(10 * (1 + index % 3)) for index, key in enumerate("abcdefgh")}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from(sorted(SIZES)), min_size=1, max_size=5, unique=True), min_size=1,
                max_size=12),
       st.sampled_from([30.0, 60.0, 100.0, 1000.0]))
def test_the_orderer_s_cache_model_agrees_with_the_fleet_s_order_index(orders: list[list[str]],
                                                                      capacity: float) -> None:
    """``OnlineOrderer.cached_estimate`` (the window planner's model of one replica's cache) and the fleet's order
    index (what the pick reads) find the same cached tokens for the same orders sent one after another."""
    orderer = OnlineOrderer()
    orderer.plan_window([list(SIZES)], [list(SIZES.values())])  # learns the block sizes
    estimate = orderer.cached_estimate(list(range(len(orders))), orders, capacity)
    fleet = FleetView(1, capacity_tokens=lambda replica: int(capacity), tokens_per_char=lambda: 1.0,
                      follow_orders=True)
    found = 0.0
    for order in orders:
        found += fleet.cached_order(0, order)
        fleet.send_order(0, order, [int(SIZES[key]) for key in order])
    assert found == estimate


def test_the_router_counts_its_load_in_the_fleet_it_reads_and_routes_by_its_blocks() -> None:
    fleet = FleetView(2, SentPrefixView(2, 10_000))
    router = Router(["http://a", "http://b"], fleet=fleet)
    prompt = text_blocks([{"role": "user", "content": "the harbor ledger lists every ship " * 40}])
    first = router.choose("k1", prompt=prompt)
    router.record("k1", first, prompt)
    router.begin(first.url)
    assert fleet.records[first.index].in_flight == 1 and fleet.records[first.index].requests == 1
    assert fleet.cached_tokens(first.index, prompt) == len(prompt.keys) * prompt.block_tokens
    again = router.choose("k2", prompt=prompt)  # another key, the same prompt: where the fleet says it is held
    assert (again.index, again.reason) == (first.index, "prefix")
    router.end(first.url)
    assert fleet.records[first.index].in_flight == 0
