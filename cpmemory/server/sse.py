"""Read an OpenAI server-sent-event stream as it passes through, to learn the answer and the usage.

The proxy forwards the engine's bytes unchanged; this collector only watches them, so that the turn can be committed
with the full answer once the stream ends cleanly. Its buffer holds at most one partial line (bounded).
"""
from __future__ import annotations

import json
from typing import Any

MAX_LINE_BYTES = 8 * 1024 * 1024


class SseCollector:
    """Accumulates ``choices[0].delta.content`` and the last ``usage`` of a chat completion stream. O(bytes)."""

    __slots__ = ("_buffer", "_parts", "broken", "done", "finished", "usage")

    def __init__(self) -> None:
        """Start with an empty buffer."""
        self._buffer = b""
        self._parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.finished = False
        self.broken = False

    @property
    def answer(self) -> str:
        """The answer text seen so far."""
        return "".join(self._parts)

    @property
    def complete(self) -> bool:
        """True when the stream ended properly (``[DONE]`` or a finish reason) and nothing was malformed."""
        return (self.done or self.finished) and not self.broken

    def feed(self, chunk: bytes) -> None:
        """Consume a chunk of bytes (any split); mutates the collector."""
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            self._line(line.strip())
        if len(self._buffer) > MAX_LINE_BYTES:
            self.broken = True
            self._buffer = b""

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.broken = True
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            self.broken = True
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        self._choice(event.get("choices"))

    def _choice(self, choices: Any) -> None:
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        delta = choices[0].get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            self._parts.append(delta["content"])
        if choices[0].get("finish_reason"):
            self.finished = True
