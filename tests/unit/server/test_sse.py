"""The SSE collector reads the same answer whatever the chunking, and flags broken streams."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.server.sse import SseCollector


def _stream(parts: list[str], usage: bool = True, done: bool = True) -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"content": part}}]} for part in parts]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        events.append({"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}})
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.text(max_size=20), max_size=8), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_chunking_gives_the_same_answer(parts: list[str], cuts: list[int]) -> None:
    raw = _stream(parts)
    positions = sorted({cut % (len(raw) + 1) for cut in cuts})
    collector = SseCollector()
    start = 0
    for position in [*positions, len(raw)]:
        collector.feed(raw[start:position])
        start = position
    assert collector.answer == "".join(parts)
    assert collector.complete and collector.usage["prompt_tokens_details"]["cached_tokens"] == 4


def test_broken_streams_are_not_complete() -> None:
    truncated = SseCollector()
    truncated.feed(_stream(["a"], done=False).split(b"data: {\"choices\": [{\"index\": 0, \"delta\": {}")[0])
    assert not truncated.complete
    garbage = SseCollector()
    garbage.feed(_stream(["a"]) + b"data: {not json\n\n")
    assert not garbage.complete
    error = SseCollector()
    error.feed(b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n')
    assert not error.complete
