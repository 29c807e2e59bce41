"""KV events lost for a replica: /metrics says its prefix score is dropped (synced 0, a gap) until it resyncs."""
from __future__ import annotations

from cpmemory.engines.kv_events import BlockStored, EventBatch, FrameProcessor, encode_frames
from cpmemory.routing.prefix import EventPrefixView
from cpmemory.server.metrics import ProxyMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scrape(metrics: ProxyMetrics, view: EventPrefixView) -> str:
    metrics.observe_prefix_view(view, 2)
    return metrics.render()[0].decode()


def test_an_event_gap_shows_as_unsynced_until_the_replica_resyncs() -> None:
    clock = Clock()
    view = EventPrefixView(2, resync_after_s=30.0, clock=clock)
    metrics = ProxyMetrics(2)
    stored = (BlockStored((1, 2), None, (0, 0, 0, 0), 2),)
    healthy, lossy = FrameProcessor(view.handler(0)), FrameProcessor(view.handler(1))
    for processor in (healthy, lossy):
        processor.process(encode_frames(EventBatch(1, 0.0, stored)))
    lossy.process(encode_frames(EventBatch(4, 0.0, stored)))  # batches 2 and 3 of replica 1 lost
    text = _scrape(metrics, view)
    assert 'cpmemory_route_prefix_view_synced{replica="0"} 1.0' in text
    assert 'cpmemory_route_prefix_view_synced{replica="1"} 0.0' in text
    assert 'cpmemory_route_prefix_view_events{counter="gaps",replica="1"} 1.0' in text
    clock.now = 31.0
    text = _scrape(metrics, view)
    assert 'cpmemory_route_prefix_view_synced{replica="1"} 1.0' in text
    assert 'cpmemory_route_prefix_view_events{counter="resyncs",replica="1"} 1.0' in text
