"""Watch an OpenAI server-sent-event stream as the proxy relays it: the answer, the usage, a clean end.

The proxy forwards the engine's bytes; this collector reads them (through :mod:`cpmemory.engines.openai_wire`) so
that the turn can be committed with choice 0's full answer once the stream ends cleanly. Choices are kept apart by
their ``index`` (``n > 1``). The proxy always asks a streaming engine for usage; when the client did not ask for it
(``strip_usage``), the usage chunk and the usage fields are removed from what is relayed, so the client receives
exactly the events it asked for. Bounded: at most one partial line is buffered.
"""
from __future__ import annotations

import json
from typing import Any

from cpmemory.engines.openai_wire import SseLineBuffer, StreamState, is_usage_chunk, sse_data


class SseCollector:
    """Reads a chat-completion stream; :meth:`feed` returns the bytes to relay. Mutable; O(bytes)."""

    __slots__ = ("_lines", "_skip_blank", "_state", "_strip_usage", "broken")

    def __init__(self, *, strip_usage: bool = False) -> None:
        """Start empty; ``strip_usage`` removes the usage the proxy asked for on the client's behalf."""
        self._lines = SseLineBuffer()
        self._state = StreamState()
        self._strip_usage = strip_usage
        self._skip_blank = False
        self.broken = False

    @property
    def answer(self) -> str:
        """Choice 0's text seen so far (the answer the turn commits)."""
        return self._state.text(0)

    def text(self, index: int) -> str:
        """The text of choice ``index`` seen so far."""
        return self._state.text(index)

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last usage object seen (None before the usage chunk)."""
        return self._state.usage

    @property
    def done(self) -> bool:
        """True once ``[DONE]`` was read."""
        return self._state.done

    @property
    def finished(self) -> bool:
        """True once choice 0 has a finish reason."""
        return self._state.finish_reason(0) is not None

    @property
    def complete(self) -> bool:
        """True when the stream ended properly (``[DONE]`` or choice 0 finished) and nothing was malformed."""
        state = self._state
        broken = self.broken or state.malformed or state.error is not None or self._lines.overflowed
        return (self.done or self.finished) and not broken

    def feed(self, chunk: bytes) -> bytes:
        """Consume a chunk of bytes (any split); return what to relay to the client (mutates the collector)."""
        relayed: list[bytes] = []
        for line in self._lines.feed(chunk):
            kept = self._line(line)
            if kept is not None:
                relayed.append(kept + b"\n")
        return chunk if not self._strip_usage else b"".join(relayed)

    def flush(self) -> bytes:
        """At the end of the stream: what is left to relay (a last line without its line break)."""
        rest = self._lines.flush()
        if not rest:
            return b""
        kept = self._line(rest)
        return b"" if not self._strip_usage or kept is None else kept

    def _line(self, line: bytes) -> bytes | None:
        data = sse_data(line)
        if data is None:
            if self._skip_blank and not line.strip():
                self._skip_blank = False
                return None
            return line
        self._skip_blank = False
        decoded, _added = self._state.apply_data(data)
        if not self._strip_usage or decoded is None or "usage" not in decoded:
            return line
        if is_usage_chunk(decoded):
            self._skip_blank = True  # drop the event's blank line too
            return None
        kept = {key: value for key, value in decoded.items() if key != "usage"}
        return b"data: " + json.dumps(kept, separators=(",", ":")).encode("ascii")
