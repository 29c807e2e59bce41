"""The OpenAI chat-completions wire format, sans-IO: the one place that builds and reads OpenAI JSON.

Used by the engine client (:mod:`cpmemory.engines.client`), the router's transport, Chain-of-Agents and the proxy.
Nothing here does IO or imports httpx.

* Requests: :func:`chat_body` (a body from messages), :func:`engine_body` (the proxy's body from a client's body),
  :func:`request_headers`, :func:`tokenize_body`, :func:`encode_body` (bytes; a lone surrogate is a typed
  ``InvalidInputError``, never an encoding crash). Every chat request carries its request id in ``X-Request-Id``
  and in body fields (``request_id`` for vLLM, ``rid`` for SGLang) and, when given, the tenant's ``cache_salt``.
* Responses: :func:`parse_usage` / :func:`usage_tokens` (``usage.prompt_tokens_details.cached_tokens``),
  :func:`response_text`, :func:`parse_chat_response`, :func:`parse_tokenize`.
* Streams (server-sent events): :class:`SseLineBuffer` cuts bytes into lines (any split, bounded),
  :class:`StreamState` folds chunks into per-choice texts (by ``index``), finish reasons and usage;
  :func:`is_usage_chunk` names the ``{"choices": [], "usage": ...}`` chunk that ``stream_options.include_usage``
  adds.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cpmemory.errors import EngineError, InvalidInputError

Message = Mapping[str, Any]
CHAT_PATH = "/v1/chat/completions"
MAX_LINE_BYTES = 8 * 1024 * 1024


# -- requests ------------------------------------------------------------------------------------------------
def chat_body(messages: Sequence[Message], *, model: str, request_id: str, stream: bool, max_tokens: int | None,
              cache_salt: str | None = None, extra: Mapping[str, Any] | None = None,
              id_fields: Sequence[str] = ("request_id",)) -> dict[str, Any]:
    """The JSON body of a chat completion. ``extra`` fields are added last (temperature, vllm_xargs, ...)."""
    body: dict[str, Any] = {"model": model, "messages": [dict(message) for message in messages], "stream": stream}
    for field_name in id_fields:
        body[field_name] = request_id
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    if cache_salt:
        body["cache_salt"] = cache_salt
    if extra:
        body.update(extra)
    return body


def asks_usage(body: Mapping[str, Any]) -> bool:
    """True when a streaming body asks for the final usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


@dataclass(frozen=True, slots=True)
class EngineBody:
    """A body for the engine built from a client's body.

    Attributes:
        body: what is sent to the engine.
        strip_usage: True when the body asks for a usage chunk the client did not ask for (remove it on relay).
    """

    body: dict[str, Any]
    strip_usage: bool


def engine_body(client_body: Mapping[str, Any], *, request_id: str, cache_salt: str | None,
                messages: Sequence[Message] | None = None, id_fields: Sequence[str] = ("request_id",)
                ) -> EngineBody:
    """The body sent to an engine: the client's fields, ``messages`` when given, the request id, the salt.

    A client-sent ``cache_salt`` or request id is replaced. A streaming body always asks for usage (the caller
    counts cached tokens); when the client did not ask for it, ``strip_usage`` says to remove it before relaying.
    Pure.
    """
    body = dict(client_body)
    if messages is not None:
        body["messages"] = [dict(message) for message in messages]
    for field_name in id_fields:
        body[field_name] = request_id
    if cache_salt:
        body["cache_salt"] = cache_salt
    strip_usage = False
    if body.get("stream") is True and not asks_usage(body):
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, Mapping) else {}), "include_usage": True}
        strip_usage = True
    return EngineBody(body, strip_usage)


def session_params(affinity_key: str) -> dict[str, str]:
    """The body field that names a request's session to a gateway with session affinity (vllm-router's
    ``--kv-aware-session-affinity-ttl-secs`` and ``consistent_hash`` read ``session_params.session_id``): an opaque
    digest of the affinity key, so the gateway learns which requests belong together and nothing else. Pure."""
    import hashlib

    return {"session_id": hashlib.blake2b(affinity_key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()}


def request_headers(request_id: str | None, api_key: str | None = None) -> dict[str, str]:
    """Headers of one request: the request id (vLLM and SGLang read X-Request-Id) and the bearer token."""
    headers: dict[str, str] = {}
    if request_id:
        headers["X-Request-Id"] = request_id
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def tokenize_body(messages: Sequence[Message] | None, prompt: str | None, model: str) -> dict[str, Any]:
    """Body of ``/tokenize``: chat messages (template applied, generation prompt added, as for a chat request)."""
    if (messages is None) == (prompt is None):
        raise ValueError("give exactly one of messages or prompt")
    if messages is not None:
        return {"model": model, "messages": [dict(message) for message in messages],
                "add_generation_prompt": True}
    return {"model": model, "prompt": prompt}


def encode_body(body: Mapping[str, Any]) -> bytes:
    """The UTF-8 JSON bytes of a request body.

    Raises:
        InvalidInputError: the body holds text that is not valid Unicode (a lone surrogate), a value JSON cannot
            carry (NaN, infinity) or an object that is not JSON. The message never repeats the offending text.
    """
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidInputError("the request holds text that is not valid Unicode (a lone surrogate)") from error
    except (TypeError, ValueError) as error:
        raise InvalidInputError(f"the request cannot be encoded as JSON ({type(error).__name__})") from error


# -- responses -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one completion (None when the engine does not report them)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_usage(usage: Any) -> Usage:
    """Read an OpenAI ``usage`` object (``prompt_tokens_details.cached_tokens`` for the prefix-cache hits)."""
    if not isinstance(usage, Mapping):
        return Usage()
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return Usage(_int_or_none(usage.get("prompt_tokens")), _int_or_none(usage.get("completion_tokens")),
                 _int_or_none(cached))


def usage_tokens(response: Mapping[str, Any]) -> tuple[int, int]:
    """Return ``(prompt_tokens, cached_tokens)`` of a response (0 when absent)."""
    usage = parse_usage(response.get("usage"))
    return usage.prompt_tokens or 0, usage.cached_tokens or 0


def response_text(response: Mapping[str, Any], index: int = 0) -> str:
    """The message content of choice ``index`` of a non-streamed response ("" when absent)."""
    choices = response.get("choices")
    if not isinstance(choices, list):
        return ""
    for position, choice in enumerate(choices):
        if isinstance(choice, Mapping) and _choice_index(choice, position) == index:
            message = choice.get("message")
            content = message.get("content") if isinstance(message, Mapping) else None
            return content if isinstance(content, str) else ""
    return ""


@dataclass(frozen=True, slots=True)
class ChatResult:
    """One finished chat completion.

    Attributes:
        request_id: the id sent with the request.
        content: the generated text (choice 0).
        prompt_tokens / completion_tokens / cached_tokens: from the usage block (cached_tokens is None when
            the engine does not report it).
        finish_reason: choice 0's finish reason.
        ttft_s: time to the first generated token (streams only; None otherwise).
        total_s: time to the end of the response.
        response_id: the engine's completion id.
    """

    request_id: str
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    ttft_s: float | None
    total_s: float
    response_id: str | None = None


def parse_chat_response(payload: Any, *, request_id: str, total_s: float) -> ChatResult:
    """Parse a non-streamed chat completion.

    Raises:
        EngineError: the payload is not a chat completion.
    """
    try:
        choice = payload["choices"][0]
        content = choice["message"].get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise EngineError(f"malformed chat completion: {str(payload)[:200]}") from error
    usage = parse_usage(payload.get("usage"))
    return ChatResult(request_id=request_id, content=content, prompt_tokens=usage.prompt_tokens,
                      completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
                      finish_reason=choice.get("finish_reason"), ttft_s=None, total_s=total_s,
                      response_id=payload.get("id"))


def model_entry(payload: Any, model: str | None) -> Mapping[str, Any] | None:
    """The entry of ``model`` in a ``GET /v1/models`` answer (the first entry when no id matches; None when there is
    none). Pure."""
    entries = payload.get("data") if isinstance(payload, Mapping) else None
    if not isinstance(entries, list):
        return None
    entries = [entry for entry in entries if isinstance(entry, Mapping)]
    return next((entry for entry in entries if entry.get("id") == model), entries[0] if entries else None)


def parse_tokenize(payload: Any) -> list[int]:
    """Token ids from a ``/tokenize`` answer. Raises EngineError when malformed."""
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(token, int) for token in tokens):
        raise EngineError(f"malformed /tokenize answer: {str(payload)[:200]}")
    return tokens


# -- streams -------------------------------------------------------------------------------------------------
def _choice_index(choice: Mapping[str, Any], position: int) -> int:
    index = choice.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else position


def is_usage_chunk(chunk: Mapping[str, Any]) -> bool:
    """True for the final usage chunk of ``include_usage`` streams: no choices, a usage object."""
    return chunk.get("choices") == [] and isinstance(chunk.get("usage"), Mapping)


def sse_data(line: bytes) -> bytes | None:
    """The payload of a ``data:`` line (stripped), None for any other line (comments, ``event:``, blanks)."""
    stripped = line.strip()
    if not stripped.startswith(b"data:"):
        return None
    return stripped[5:].strip()


class SseLineBuffer:
    """Cuts a byte stream into complete lines, whatever the chunking. Holds at most one partial line. Mutable.

    ``overflowed`` becomes True (and the partial line is dropped) when a line grows past ``MAX_LINE_BYTES``.
    """

    __slots__ = ("_buffer", "overflowed")

    def __init__(self) -> None:
        """Start empty."""
        self._buffer = b""
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """Return the lines completed by ``chunk``, each without its line break. O(len(chunk))."""
        self._buffer += chunk
        if b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE_BYTES:
                self.overflowed, self._buffer = True, b""
            return []
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > MAX_LINE_BYTES:
            self.overflowed, self._buffer = True, b""
        return [line[:-1] if line.endswith(b"\r") else line for line in lines]

    def flush(self) -> bytes:
        """Return (and forget) the partial line held, at the end of the stream."""
        rest, self._buffer = self._buffer, b""
        return rest


class StreamState:
    """What a chat-completion stream said so far: text and finish reason per choice ``index``, usage, errors.

    Feed it the decoded chunks (:meth:`apply`) or the ``data:`` payloads (:meth:`apply_data`). Mutable; O(bytes).
    """

    __slots__ = ("_finish", "_parts", "done", "error", "malformed", "response_id", "usage")

    def __init__(self) -> None:
        """Start with nothing seen."""
        self._parts: dict[int, list[str]] = {}
        self._finish: dict[int, str] = {}
        self.usage: dict[str, Any] | None = None
        self.response_id: str | None = None
        self.done = False
        self.error: Any = None
        self.malformed = False

    def text(self, index: int = 0) -> str:
        """The text of choice ``index`` so far."""
        return "".join(self._parts.get(index, ()))

    def finish_reason(self, index: int = 0) -> str | None:
        """The finish reason of choice ``index`` (None while it runs)."""
        return self._finish.get(index)

    def apply_data(self, data: bytes | str) -> tuple[Mapping[str, Any] | None, dict[int, str]]:
        """Consume one ``data:`` payload; return the decoded chunk (None for ``[DONE]`` or garbage) and the text
        it added per choice. A payload that is not a JSON object sets ``malformed``."""
        if data in (b"[DONE]", "[DONE]"):
            self.done = True
            return None, {}
        try:
            chunk = json.loads(data)
        except ValueError:
            self.malformed = True
            return None, {}
        if not isinstance(chunk, dict):
            self.malformed = True
            return None, {}
        return chunk, self.apply(chunk)

    def apply(self, chunk: Mapping[str, Any]) -> dict[int, str]:
        """Consume one decoded chunk; return the text it added, per choice index."""
        if "error" in chunk:
            self.error = chunk["error"]
        if self.response_id is None and isinstance(chunk.get("id"), str):
            self.response_id = chunk["id"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        added: dict[int, str] = {}
        choices = chunk.get("choices")
        for position, choice in enumerate(choices if isinstance(choices, list) else ()):
            if not isinstance(choice, Mapping):
                continue
            index = _choice_index(choice, position)
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, Mapping) else choice.get("text")
            if isinstance(piece, str) and piece:
                self._parts.setdefault(index, []).append(piece)
                added[index] = added.get(index, "") + piece
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self._finish[index] = reason
        return added
