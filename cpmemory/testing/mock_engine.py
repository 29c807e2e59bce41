"""An in-process fake of a vLLM OpenAI server, for unit tests and examples (no network, no model).

:class:`MockEngine` answers the endpoints cpmemory uses through httpx's transport seam::

    engine = MockEngine(block_size=16, capacity_blocks=64)
    client = EngineClient("http://mock", transport=engine.transport())

It behaves like vLLM's automatic prefix caching where cpmemory can observe it: prompts are tokenized (ChatML
template, one token per UTF-8 byte), cut into full blocks named by vLLM's chained hashes
(:class:`~cpmemory.engines.block_hashes.BlockHasher`), a request's ``cached_tokens`` is the length of its
leading run of cached blocks, and the cache is LRU over ``capacity_blocks`` blocks. Every change is published as
a KV-event batch (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) to ``listener`` (which receives the
encoded ZMQ frames, exactly as a subscriber would) and kept in ``batches``.

Optional behaviour for tests: ``prefill_s_per_token`` sleeps per uncached prompt token (so TTFT depends on the
cache), and :meth:`MockEngine.fail_next`, :meth:`MockEngine.hang_next` and ``down`` inject errors, timeouts and
connection failures. The mock is thread-safe (one lock).
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cpmemory.engines.block_hashes import BlockHasher
from cpmemory.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_frames,
)
from cpmemory.errors import MissingDependencyError

FrameListener = Callable[[list[bytes]], None]
Reply = Callable[[Mapping[str, Any]], str]
_TOKEN_OFFSET = 3  # ids 0..2 are the special tokens, as in the tiny model's tokenizer


def render_chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The ChatML text a chat template renders (the tiny model's template)."""
    text = "".join(f"<|im_start|>{message['role']}\n{message.get('content') or ''}<|im_end|>\n"
                   for message in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _reply_ok(_body: Mapping[str, Any]) -> str:
    return "ok"


def _pieces(text: str) -> list[str]:
    """Stream deltas of a text: words with their following spaces (at least one piece)."""
    return re.findall(r"\S+\s*|\s+", text) or [""]


def mock_tokenize(text: str) -> list[int]:
    """One token per UTF-8 byte (prefix-stable: a text's prefix tokenizes to a prefix)."""
    return [byte + _TOKEN_OFFSET for byte in text.encode("utf-8")]


class MockEngine:
    """A fake OpenAI-compatible engine with an LRU prefix cache and KV events. See the module docstring."""

    def __init__(self, *, block_size: int = 16, capacity_blocks: int = 256, model: str = "tiny",
                 prefill_s_per_token: float = 0.0, listener: FrameListener | None = None,
                 reply: Reply | None = None, max_model_len: int = 1 << 20, token_bytes: int = 1,
                 records: int | None = None) -> None:
        """An empty cache of ``capacity_blocks`` blocks of ``block_size`` tokens; ``reply`` makes choice 0's
        answer from the request body (default ``"ok"``; choice ``i > 0`` answers it followed by ``" #i"``);
        ``max_model_len`` is what ``/v1/models`` and ``/tokenize`` report; ``token_bytes``: UTF-8 bytes per token
        (1: :func:`mock_tokenize`; more: a tokenizer more frugal than cpmemory's default estimate); ``records``: keep
        only the latest this many ``requests`` and ``batches`` (None: every one, as tests read them)."""
        self.reply = reply or _reply_ok
        self.hasher = BlockHasher(block_size)
        self.capacity_blocks = capacity_blocks
        self.model = model
        self.max_model_len = max_model_len
        self.token_bytes = token_bytes
        self.prefill_s_per_token = prefill_s_per_token
        self.listener = listener
        self.down = False
        self.batches: list[EventBatch] | deque[EventBatch] = [] if records is None else deque(maxlen=records)
        self.requests: list[dict[str, Any]] | deque[dict[str, Any]] = [] if records is None else deque(maxlen=records)
        self._chats = 0  # chat requests received (their default ids)
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._sequence = 0
        self._failures: list[int] = []
        self._hangs = 0
        self._busy_resets = 0
        self._queries = 0
        self._hits = 0

    # -- test controls --------------------------------------------------------------------------------------
    def fail_next(self, count: int = 1, status: int = 500) -> None:
        """Answer the next ``count`` requests with HTTP ``status``."""
        with self._lock:
            self._failures.extend([status] * count)

    def hang_next(self, count: int = 1) -> None:
        """Let the next ``count`` requests time out (httpx.ReadTimeout), as a hung engine would."""
        with self._lock:
            self._hangs += count

    def refuse_resets(self, count: int = 1) -> None:
        """Answer the next ``count`` resets with ``{"success": false}`` (vLLM does while blocks are held)."""
        with self._lock:
            self._busy_resets += count

    def cached_blocks(self) -> list[int]:
        """Hashes of the cached blocks, least recently used first."""
        with self._lock:
            return list(self._cache)

    def transport(self):
        """An httpx transport (usable by sync and async clients) that routes requests to this engine."""
        try:
            import httpx
        except ImportError as error:
            raise MissingDependencyError("engines", "httpx") from error
        return httpx.MockTransport(self.handle)

    # -- HTTP -----------------------------------------------------------------------------------------------
    def handle(self, request):
        """Answer one httpx request (the MockTransport handler)."""
        import httpx

        if self.down:
            raise httpx.ConnectError("mock engine is down", request=request)
        with self._lock:
            status = self._failures.pop(0) if self._failures else None
            hang = self._hangs > 0
            self._hangs -= int(hang)
        if hang:
            raise httpx.ReadTimeout("mock engine hung", request=request)
        if status is not None:
            return httpx.Response(status, json={"error": {"message": "injected failure", "code": status}})
        routes = {("POST", "/v1/chat/completions"): self._chat, ("POST", "/tokenize"): self._tokenize,
                  ("GET", "/metrics"): self._metrics, ("GET", "/health"): lambda _request: httpx.Response(200),
                  ("POST", "/reset_prefix_cache"): self._reset, ("GET", "/v1/models"): self._models}
        route = routes.get((request.method, request.url.path))
        if route is None:
            return httpx.Response(404, json={"error": {"message": "not found"}})
        return route(request)

    def tokenize(self, text: str) -> list[int]:
        """This engine's token ids of ``text`` (``token_bytes`` UTF-8 bytes per token, prefix-stable)."""
        if self.token_bytes == 1:
            return mock_tokenize(text)
        data, step = text.encode("utf-8"), self.token_bytes
        return [int.from_bytes(data[i:i + step], "big") % 60_000 + _TOKEN_OFFSET for i in range(0, len(data), step)]

    def _tokenize(self, request):
        import httpx

        body = json.loads(request.content or b"{}")
        if "messages" in body:
            text = render_chatml(body["messages"], body.get("add_generation_prompt", True))
        else:
            text = str(body.get("prompt", ""))
        tokens = self.tokenize(text)
        return httpx.Response(200, json={"count": len(tokens), "tokens": tokens, "max_model_len": self.max_model_len})

    def _models(self, _request):
        import httpx

        return httpx.Response(200, json={"object": "list", "data": [
            {"id": self.model, "object": "model", "max_model_len": self.max_model_len}]})

    def _metrics(self, _request):
        import httpx

        with self._lock:
            lines = [
                (f'vllm:cache_config_info{{block_size="{self.hasher.block_size}",enable_prefix_caching="True",'
                f'num_gpu_blocks="{self.capacity_blocks}",prefix_caching_hash_algo="{self.hasher.algorithm}"}} 1.0'),
                f'vllm:prefix_cache_queries_total{{model_name="{self.model}"}} {self._queries}',
                f'vllm:prefix_cache_hits_total{{model_name="{self.model}"}} {self._hits}',
            ]
        return httpx.Response(200, text="\n".join(lines) + "\n")

    def _reset(self, _request):
        import httpx

        with self._lock:
            if self._busy_resets:
                self._busy_resets -= 1
                return httpx.Response(200, json={"success": False})
            self._cache.clear()
            self._publish([AllBlocksCleared()])
        return httpx.Response(200, json={"success": True})

    def _chat(self, request):
        import httpx

        body = json.loads(request.content or b"{}")
        request_id = request.headers.get("x-request-id") or body.get("request_id") or f"mock-{self._chats}"
        tokens = self.tokenize(render_chatml(body.get("messages") or []))
        cached = self._run_prefill(tokens, body.get("cache_salt"))
        self.requests.append({"request_id": request_id, "body": body, "cached_tokens": cached})
        self._chats += 1
        if self.prefill_s_per_token:
            time.sleep((len(tokens) - cached) * self.prefill_s_per_token)
        answer = self.reply(body)
        texts = [answer if index == 0 else f"{answer} #{index}" for index in range(_choice_count(body))]
        completion = sum(len(_pieces(text)) for text in texts)
        usage = {"prompt_tokens": len(tokens), "completion_tokens": completion, "total_tokens": len(tokens) + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        response_id = f"chatcmpl-{request_id}"
        if not body.get("stream"):
            return httpx.Response(200, json={
                "id": response_id, "object": "chat.completion", "model": self.model, "usage": usage,
                "choices": [{"index": index, "message": {"role": "assistant", "content": text},
                             "finish_reason": "length"} for index, text in enumerate(texts)]})
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True
        text = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in _stream_chunks(response_id, texts, usage,
                                                                                       include_usage))
        return httpx.Response(200, text=text + "data: [DONE]\n\n", headers={"content-type": "text/event-stream"})

    # -- cache ----------------------------------------------------------------------------------------------
    def _run_prefill(self, tokens: Sequence[int], cache_salt: str | None) -> int:
        """Match the leading cached blocks, store the rest, evict LRU blocks; publish events. Returns cached tokens."""
        hashes = self.hasher.hashes(tokens, cache_salt=cache_salt)
        size = self.hasher.block_size
        with self._lock:
            hits = 0
            while hits < len(hashes) and hashes[hits] in self._cache:
                self._cache.move_to_end(hashes[hits])
                hits += 1
            # like vLLM, always compute at least the last prompt token
            cached = min(hits * size, ((len(tokens) - 1) // size) * size)
            self._queries += len(tokens)
            self._hits += cached
            events: list[KVEvent] = []
            new = hashes[hits:]
            removed = self._make_room(len(new), keep=set(hashes[:hits]))
            if removed:
                events.append(BlockRemoved(block_hashes=tuple(removed), medium="GPU"))
            if new:
                for block_hash in new:
                    self._cache[block_hash] = None
                extra = tuple([cache_salt] if cache_salt and index == 0 else None for index in range(hits, len(hashes)))
                events.append(BlockStored(
                    block_hashes=tuple(new), parent_block_hash=hashes[hits - 1] if hits else None,
                    token_ids=tuple(tokens[hits * size:len(hashes) * size]), block_size=size,
                    extra_keys=extra, medium="GPU"))
            if events:
                self._publish(events)
        return cached

    def _make_room(self, needed: int, keep: set[int]) -> list[int]:
        removed: list[int] = []
        for block_hash in list(self._cache):
            if len(self._cache) + needed <= self.capacity_blocks:
                break
            if block_hash not in keep:
                del self._cache[block_hash]
                removed.append(block_hash)
        return removed

    def _publish(self, events: list[KVEvent]) -> None:
        batch = EventBatch(sequence=self._sequence, timestamp=time.time(), events=tuple(events))
        self._sequence += 1
        self.batches.append(batch)
        if self.listener is not None:
            self.listener(encode_frames(batch))


def _choice_count(body: Mapping[str, Any]) -> int:
    count = body.get("n", 1)
    return count if isinstance(count, int) and 1 <= count <= 16 else 1


def _stream_chunks(response_id: str, texts: Sequence[str], usage: Mapping[str, Any],
                   include_usage: bool) -> list[dict[str, Any]]:
    """The chunks of a streamed answer, as vLLM sends them: a role chunk per choice, then the deltas of every
    choice interleaved (each chunk names its choice ``index``), a finish reason per choice, the usage chunk."""
    chunks: list[dict[str, Any]] = [
        {"id": response_id, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}}]}
        for index in range(len(texts))]
    pieces = [_pieces(text) for text in texts]
    for position in range(max(len(run) for run in pieces)):
        for index, run in enumerate(pieces):
            if position < len(run):
                last = position == len(run) - 1
                chunks.append({"id": response_id, "choices": [{"index": index, "delta": {"content": run[position]},
                                                               "finish_reason": "length" if last else None}]})
    if include_usage:
        chunks.append({"id": response_id, "choices": [], "usage": dict(usage)})
    return chunks
