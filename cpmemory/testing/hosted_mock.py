"""Local stand-ins for OpenAI's and Anthropic's chat APIs that apply each provider's documented prompt-cache rules.

Tests and ``bench hosted`` send the real ``openai`` / ``anthropic`` SDKs (or cpmemory's hosted transport) here
through ``httpx.MockTransport`` (:meth:`transport`), so nothing leaves the process. The rules, as the providers
document them (sources in ``docs/guides/hosted.md``):

- OpenAI (:class:`OpenAICacheMock`): a prompt of at least ``minimum`` tokens is cached by itself; a later prompt
  reads the longest cached prefix of ``minimum + k * increment`` tokens, on the machine its route reaches (a hash
  of its first ``route_prefix_tokens`` tokens and its ``prompt_cache_key``; a route sent more than
  ``overflow_per_minute`` requests in a minute spills to other machines); an entry lives ``retention_s`` after its
  last use. Usage: ``prompt_tokens_details.cached_tokens``. Unknown request arguments are refused (400).
- Anthropic (:class:`AnthropicCacheMock`): only prefixes ending at a ``cache_control`` block are written (at most
  ``max_breakpoints`` per request, else 400; a one-hour breakpoint may not follow a five-minute one); a breakpoint
  reads the latest entry at its own block or up to ``lookback_blocks`` blocks before it; a prefix shorter than the
  model's minimum is neither written nor billed as a write; an entry lives five minutes (or one hour) after its
  last use. Usage: ``input_tokens`` (after the last cached or written token), ``cache_creation_input_tokens``,
  ``cache_read_input_tokens`` and ``cache_creation`` by lifetime.

Time comes from an injected clock (:class:`ManualClock`), tokens from an injected ``tokenize`` (text -> ints; the
default counts one token per word with its leading space). Both mocks keep every call's usage in ``calls``.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["AnthropicCacheMock", "ManualClock", "OpenAICacheMock", "word_tokens"]

_WORD = re.compile(r"\s*\S+|\s+")
ANTHROPIC_MINIMUMS = {  # minimum cacheable prompt per model family (longest prefix wins)
    "claude-opus-4-5": 4096, "claude-haiku-4-5": 4096, "claude-3-5-haiku": 2048, "claude-3-haiku": 2048,
    "claude-sonnet": 1024, "claude-opus-4": 1024,
}
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
OPENAI_ARGUMENTS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "user", "seed", "tools", "tool_choice", "parallel_tool_calls", "response_format", "prompt_cache_key",
    "prompt_cache_retention", "metadata", "store", "reasoning_effort", "service_tier", "safety_identifier",
})


def word_tokens(text: str) -> tuple[int, ...]:
    """One token per word with its leading whitespace (stable ids). Pure."""
    return tuple(int.from_bytes(hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=7).digest(),
                                "little") for piece in _WORD.findall(text))


@dataclass(slots=True)
class ManualClock:
    """A clock tests move by hand: ``clock()`` is the time in seconds."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True, slots=True)
class _Reply:
    """An HTTP answer, built as a response of whichever httpx flavour the client uses (see ``_Mock.transport``)."""

    status: int
    json: Any = None
    content: bytes | None = None
    headers: Mapping[str, str] | None = None


def _error(status: int, body: dict[str, Any]) -> _Reply:
    return _Reply(status, json=body)


class _TokenCache:
    """Each text's tokens as an int64 array, memoised (block and history texts repeat across calls)."""

    def __init__(self, tokenize: Callable[[str], Sequence[int]]) -> None:
        self._tokenize = tokenize
        self._memo: dict[str, np.ndarray] = {}

    def __call__(self, text: str) -> np.ndarray:
        found = self._memo.get(text)
        if found is None:
            found = np.asarray(self._tokenize(text), dtype=np.int64)
            if len(self._memo) > 200_000:
                self._memo.clear()
            self._memo[text] = found
        return found


def _prefix_digests(tokens: np.ndarray, ends: Sequence[int]) -> list[bytes]:
    """The digest of ``tokens[:end]`` for each end (ascending), in one pass. O(len(tokens))."""
    raw = tokens.tobytes()
    hasher = hashlib.blake2b(digest_size=16)
    out, start = [], 0
    for end in ends:
        hasher.update(raw[start * 8:end * 8])
        start = end
        out.append(hasher.copy().digest())
    return out


def _text_parts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)]
    return []


@dataclass(slots=True)
class _Call:
    usage: dict[str, Any]
    body: dict[str, Any] = field(repr=False)


class _Mock:
    def __init__(self, clock: Callable[[], float] | None, tokenize: Callable[[str], Sequence[int]] | None,
                 answer: Callable[[Mapping[str, Any]], str] | None, api_key: str) -> None:
        self.clock = clock or ManualClock()
        self.tokens = _TokenCache(tokenize or word_tokens)
        self.answer = answer or (lambda body: "OK.")
        self.api_key = api_key
        self.calls: list[_Call] = []

    def transport(self, http: Any = None) -> Any:
        """A ``MockTransport`` serving this mock (sync and async clients) of the ``http`` module: ``httpx`` by
        default, or the one an SDK is built on (a newer ``anthropic`` uses ``httpx2``)."""
        if http is None:
            import httpx as http
        return http.MockTransport(lambda request: self._response(http, request))

    def handle(self, request: Any) -> Any:
        """Serve one ``httpx`` request."""
        import httpx

        return self._response(httpx, request)

    def _response(self, http: Any, request: Any) -> Any:
        reply = self.serve(request)
        if reply.content is not None:
            return http.Response(reply.status, content=reply.content, headers=dict(reply.headers or {}))
        return http.Response(reply.status, json=reply.json)

    def serve(self, request: Any) -> _Reply:  # pragma: no cover - implemented by each provider
        raise NotImplementedError

    def _body(self, request: Any) -> dict[str, Any] | None:
        try:
            body = json.loads(request.content or b"{}")
        except ValueError:
            return None
        return body if isinstance(body, dict) else None


class OpenAICacheMock(_Mock):
    """OpenAI's Chat Completions API with its automatic prompt cache (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float] | None = None,
                 tokenize: Callable[[str], Sequence[int]] | None = None,
                 answer: Callable[[Mapping[str, Any]], str] | None = None, api_key: str = "test-key",
                 minimum: int = 1024, increment: int = 128, retention_s: float = 300.0,
                 route_prefix_tokens: int = 256, overflow_per_minute: int = 15) -> None:
        super().__init__(clock, tokenize, answer, api_key)
        self.minimum, self.increment, self.retention_s = minimum, increment, retention_s
        self.route_prefix_tokens, self.overflow_per_minute = route_prefix_tokens, overflow_per_minute
        self._machines: dict[Any, dict[bytes, float]] = {}
        self._route_times: dict[Any, list[float]] = {}

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """The prompt as tokens: each message's role marker, then its text."""
        parts = []
        for message in messages:
            parts.append(self.tokens(f"<|{message.get('role')}|>"))
            parts.extend(self.tokens(text) for text in _text_parts(message.get("content")))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _machine(self, key: str, tokens: np.ndarray, now: float) -> dict[bytes, float]:
        route = (key, hashlib.blake2b(tokens[:self.route_prefix_tokens].tobytes(), digest_size=16).digest())
        recent = [stamp for stamp in self._route_times.get(route, []) if stamp > now - 60.0]
        recent.append(now)
        self._route_times[route] = recent
        spill = (len(recent) - 1) // self.overflow_per_minute  # past the rate, requests reach other machines
        return self._machines.setdefault((route, spill), {})

    def _cached(self, tokens: np.ndarray, key: str) -> int:
        now = self.clock()
        machine = self._machine(key, tokens, now)
        if len(tokens) < self.minimum:
            return 0
        ends = list(range(self.minimum, len(tokens) + 1, self.increment))
        digests = _prefix_digests(tokens, ends)
        cached = 0
        for end, digest in zip(ends, digests):
            expires = machine.get(digest)
            if expires is not None and expires >= now:
                cached = end
        for digest in digests:
            machine[digest] = now + self.retention_s
        return cached

    def serve(self, request: Any) -> _Reply:
        """Serve one HTTP request (``POST /v1/chat/completions``)."""
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return _error(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                          "param": None, "code": "invalid_api_key"}})
        if not request.url.path.endswith("/chat/completions") or request.method != "POST":
            return _error(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
        body = self._body(request)
        if body is None or not isinstance(body.get("messages"), list) or not isinstance(body.get("model"), str):
            return _error(400, {"error": {"message": "model and messages are required",
                                          "type": "invalid_request_error", "param": None, "code": None}})
        unknown = sorted(set(body) - OPENAI_ARGUMENTS)
        if unknown:
            return _error(400, {"error": {"message": f"Unrecognized request argument supplied: {unknown[0]}",
                                          "type": "invalid_request_error", "param": unknown[0], "code": None}})
        tokens = self.prompt_tokens(body["messages"])
        found = body.get("prompt_cache_key")
        key = found if isinstance(found, str) else ""
        cached = self._cached(tokens, key)
        text = self.answer(body)
        output = len(self.tokens(text))
        usage = {"prompt_tokens": len(tokens), "completion_tokens": output, "total_tokens": len(tokens) + output,
                 "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0}}
        self.calls.append(_Call(usage, body))
        number = len(self.calls)
        if body.get("stream"):
            return self._stream(body, text, usage, number)
        return _Reply(200, json={
            "id": f"chatcmpl-mock{number}", "object": "chat.completion", "created": int(self.clock()),
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "logprobs": None}],
            "usage": usage,
        })

    def _stream(self, body: Mapping[str, Any], text: str, usage: dict[str, Any], number: int) -> _Reply:
        base = {"id": f"chatcmpl-mock{number}", "object": "chat.completion.chunk", "created": int(self.clock()),
                "model": body["model"]}
        chunks = [
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
        options = body.get("stream_options")
        if isinstance(options, Mapping) and options.get("include_usage"):
            chunks.append({**base, "choices": [], "usage": usage})
        payload = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return _Reply(200, content=payload.encode(), headers={"content-type": "text/event-stream"})


class AnthropicCacheMock(_Mock):
    """Anthropic's Messages API with its breakpoint prompt cache (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float] | None = None,
                 tokenize: Callable[[str], Sequence[int]] | None = None,
                 answer: Callable[[Mapping[str, Any]], str] | None = None, api_key: str = "test-key",
                 minimums: Mapping[str, int] | None = None, default_minimum: int = 1024,
                 lookback_blocks: int = 20, max_breakpoints: int = 4) -> None:
        super().__init__(clock, tokenize, answer, api_key)
        self.minimums = dict(ANTHROPIC_MINIMUMS if minimums is None else minimums)
        self.default_minimum, self.lookback_blocks, self.max_breakpoints = default_minimum, lookback_blocks, \
            max_breakpoints
        self._entries: dict[bytes, tuple[float, float]] = {}  # prefix digest -> (expires, lifetime)

    def minimum(self, model: str) -> int:
        """The minimum cacheable prompt of ``model`` (longest listed prefix, else the default)."""
        best = max((name for name in self.minimums if model.startswith(name)), key=len, default=None)
        return self.minimums[best] if best is not None else self.default_minimum

    def _blocks(self, body: Mapping[str, Any]) -> list[tuple[np.ndarray, Mapping[str, Any] | None]]:
        out: list[tuple[np.ndarray, Mapping[str, Any] | None]] = []
        system = body.get("system")
        system_blocks: list[Mapping[str, Any]] = [{"type": "text", "text": system}] if isinstance(system, str) \
            else list(system or [])
        for block in system_blocks:
            out.append((self.tokens(block.get("text", "")), block.get("cache_control")))
        for message in body["messages"]:
            content = message.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            marker = self.tokens(f"<|{message.get('role')}|>")
            for index, block in enumerate(blocks):
                tokens = self.tokens(block.get("text", ""))
                out.append((np.concatenate([marker, tokens]) if index == 0 else tokens, block.get("cache_control")))
        return out

    def _invalid(self, body: dict[str, Any] | None) -> str | None:
        if body is None or not isinstance(body.get("messages"), list) or not body["messages"]:
            return "messages: field required"
        if not isinstance(body.get("model"), str) or not isinstance(body.get("max_tokens"), int):
            return "model and max_tokens: field required"
        for message in body["messages"]:
            if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
                return "messages: roles must be user or assistant"
        markers: list[Mapping[str, Any]] = [block["cache_control"] for _, block in self._raw_blocks(body)
                                            if isinstance(block.get("cache_control"), Mapping)]
        if len(markers) > self.max_breakpoints:
            return (f"A maximum of {self.max_breakpoints} blocks with cache_control may be provided. "
                    f"Found {len(markers)}.")
        lifetimes = [marker.get("ttl", "5m") for marker in markers]
        if any(ttl not in TTL_SECONDS for ttl in lifetimes):
            return "cache_control.ttl must be '5m' or '1h'"
        if "5m" in lifetimes and "1h" in lifetimes[lifetimes.index("5m"):]:
            return "a cache_control block with ttl='1h' cannot come after one with ttl='5m'"
        return None

    @staticmethod
    def _raw_blocks(body: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
        system = body.get("system")
        blocks = [block for block in system if isinstance(block, Mapping)] if isinstance(system, list) else []
        for message in body["messages"]:
            content = message.get("content")
            if isinstance(content, list):
                blocks.extend(block for block in content if isinstance(block, Mapping))
        return list(enumerate(blocks))

    def _account(self, body: Mapping[str, Any]) -> dict[str, int]:
        now = self.clock()
        blocks = self._blocks(body)
        ends = list(np.cumsum([len(tokens) for tokens, _ in blocks]))
        tokens = np.concatenate([tokens for tokens, _ in blocks])
        digests = _prefix_digests(tokens, ends)
        breakpoints = [index for index, (_, marker) in enumerate(blocks) if marker]
        read, read_at = 0, -1
        for point in breakpoints:
            for index in range(point, max(-1, point - self.lookback_blocks - 1), -1):
                entry = self._entries.get(digests[index])
                if entry is not None and entry[0] >= now:
                    if ends[index] > read:
                        read, read_at = int(ends[index]), index
                    break
        if read_at >= 0:  # a read refreshes the entry's lifetime
            lifetime_s = self._entries[digests[read_at]][1]
            self._entries[digests[read_at]] = (now + lifetime_s, lifetime_s)
        minimum = self.minimum(str(body["model"]))
        written = {"5m": 0, "1h": 0}
        done = read
        for point in breakpoints:
            end = int(ends[point])
            if end <= done or end < minimum:
                continue
            lifetime = str(blocks[point][1].get("ttl", "5m"))  # type: ignore[union-attr]
            written[lifetime] += end - done
            self._entries[digests[point]] = (now + TTL_SECONDS[lifetime], TTL_SECONDS[lifetime])
            done = end
        total = int(ends[-1]) if ends else 0
        creation = written["5m"] + written["1h"]
        return {"input_tokens": total - read - creation, "cache_creation_input_tokens": creation,
                "cache_read_input_tokens": read, "ephemeral_5m": written["5m"], "ephemeral_1h": written["1h"]}

    def serve(self, request: Any) -> _Reply:
        """Serve one HTTP request (``POST /v1/messages``)."""
        if self.api_key not in (request.headers.get("x-api-key"),
                                (request.headers.get("authorization") or "").removeprefix("Bearer ")):
            return _error(401, {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "invalid x-api-key"}})
        if not request.headers.get("anthropic-version"):
            return _error(400, {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": "anthropic-version: header is required"}})
        if not request.url.path.endswith("/v1/messages") or request.method != "POST":
            return _error(404, {"type": "error", "error": {"type": "not_found_error", "message": "not found"}})
        body = self._body(request)
        problem = self._invalid(body)
        if problem is not None or body is None:
            return _error(400, {"type": "error", "error": {"type": "invalid_request_error", "message": problem}})
        counts = self._account(body)
        text = self.answer(body)
        usage = {"input_tokens": counts["input_tokens"], "output_tokens": len(self.tokens(text)),
                 "cache_creation_input_tokens": counts["cache_creation_input_tokens"],
                 "cache_read_input_tokens": counts["cache_read_input_tokens"],
                 "cache_creation": {"ephemeral_5m_input_tokens": counts["ephemeral_5m"],
                                    "ephemeral_1h_input_tokens": counts["ephemeral_1h"]}}
        self.calls.append(_Call(usage, body))
        if body.get("stream"):
            return self._stream(body, text, usage)
        return _Reply(200, json={
            "id": f"msg_mock{len(self.calls)}", "type": "message", "role": "assistant", "model": body["model"],
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": usage,
        })

    def _stream(self, body: Mapping[str, Any], text: str, usage: dict[str, Any]) -> _Reply:
        """The Messages API's event stream: the input usage in ``message_start``, the output in ``message_delta``."""
        start_usage = {**usage, "output_tokens": 1}
        events = [
            ("message_start", {"type": "message_start", "message": {
                "id": f"msg_mock{len(self.calls)}", "type": "message", "role": "assistant", "model": body["model"],
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": text}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": usage["output_tokens"]}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        payload = "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)
        return _Reply(200, content=payload.encode(), headers={"content-type": "text/event-stream"})
