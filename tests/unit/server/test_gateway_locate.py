"""Behind a gateway, which replica served a prompt (``KVSyncHub.locate``): the one whose KV events stored strictly
the most of its leading blocks, and nobody while a replica's events were lost."""
from __future__ import annotations

from cpmemory.engines.kv_events import BlockStored, EventBatch
from cpmemory.routing.prefix import EventPrefixView, PromptBlocks
from cpmemory.server.kv_sync import KVSyncHub, _Replica

PROMPT = PromptBlocks(keys=(101, 102, 103), block_tokens=16, total_tokens=50)


def hub_with(view: EventPrefixView) -> KVSyncHub:
    hub = KVSyncHub(memory=None, engines=["http://a", "http://b"], endpoints=["tcp://a:1", "tcp://b:2"], view=view)
    for index, url in enumerate(hub.engines):
        hub._replicas[index] = _Replica(url, sync=None, subscriber=None, client=None)
    return hub


def store(view: EventPrefixView, replica: int, keys: tuple[int, ...], sequence: int) -> None:
    view.apply(replica, EventBatch(sequence, 0.0, (BlockStored(keys, None, tuple(range(16 * len(keys))), 16),)))


def test_the_replica_holding_strictly_the_most_leading_blocks_served_the_prompt() -> None:
    view = EventPrefixView(2)
    hub = hub_with(view)
    assert hub.locate(PROMPT) is None  # nothing stored anywhere
    store(view, 0, (101,), 1)  # a shared first block (say, the system prompt) on replica 0
    store(view, 1, (101, 102, 103), 1)
    assert hub.locate(PROMPT) == 1
    store(view, 0, (102, 103), 2)  # the same prompt cached on both: no replica stands out
    assert hub.locate(PROMPT) is None


def test_no_replica_is_credited_while_another_ones_events_are_lost() -> None:
    """A replica whose events were lost shows an empty cache until it resyncs: it may have served the prompt."""
    view = EventPrefixView(2)
    hub = hub_with(view)
    store(view, 1, (101,), 1)
    assert hub.locate(PROMPT) == 1
    view.gap(0)
    assert hub.locate(PROMPT) is None
