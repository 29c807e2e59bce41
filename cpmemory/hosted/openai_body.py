"""The request cpmemory sends to OpenAI's Chat Completions API: the client's body with a stable
``prompt_cache_key`` and without the fields only a self-hosted engine understands. Pure; no IO.

OpenAI caches a prompt by itself from 1,024 tokens, in 128-token steps, on the machine a request is routed to; the
route is a hash of the prompt's start combined with ``prompt_cache_key``. Requests that share a prefix reach the
same cache when they carry the same key, so cpmemory gives every turn of a conversation one key (its tenant and
conversation) and every stateless call the key of its shared prefix (the system prompt and the start of its first
user message, where cpmemory places the blocks it orders first). A key the client sent is kept.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ENGINE_ONLY_FIELDS", "PREFIX_KEY_CHARS", "conversation_cache_key", "openai_request", "prefix_cache_key"]

ENGINE_ONLY_FIELDS = ("cache_salt", "request_id", "priority", "session_params")
"""Fields the proxy adds for vLLM and its gateways; OpenAI rejects unknown request arguments."""

PREFIX_KEY_CHARS = 4096
"""How much of the first user message names a stateless call's shared prefix (about OpenAI's 1,024-token minimum
at four characters a token: a shorter shared start is not cached anyway)."""


def _digest(*parts: str) -> str:
    hasher = hashlib.blake2b(digest_size=12)
    for part in parts:
        hasher.update(part.encode("utf-8", "surrogatepass"))
        hasher.update(b"\x00")
    return "cpm-" + hasher.hexdigest()


def conversation_cache_key(tenant: str, conversation_id: str) -> str:
    """The key of every turn of one conversation: an opaque digest (no user data leaves in clear). Pure."""
    return _digest("conversation", tenant, conversation_id)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping)
                       and isinstance(part.get("text"), str))
    return ""


def prefix_cache_key(messages: Sequence[Mapping[str, Any]], tenant: str = "") -> str:
    """The key of a call by its shared prefix: the system messages and the first ``PREFIX_KEY_CHARS`` characters
    of the first user message. Every turn of a conversation sent through cpmemory gets the same key (its history is
    prefix-stable, so its first user message never changes); stateless calls that open with the same blocks share
    one. Pure; O(prefix)."""
    system = [_text(message.get("content")) for message in messages if message.get("role") in ("system", "developer")]
    first_user = next((_text(message.get("content")) for message in messages if message.get("role") == "user"), "")
    return _digest("prefix", tenant, *system, first_user[:PREFIX_KEY_CHARS])


def openai_request(body: Mapping[str, Any], *, cache_key: str | None = None, model: str | None = None
                   ) -> dict[str, Any]:
    """The body for OpenAI: ``body`` less :data:`ENGINE_ONLY_FIELDS`, ``model`` when given, and ``cache_key`` as
    ``prompt_cache_key`` (else the prefix key of its messages) unless the client sent one. Pure."""
    out = {key: value for key, value in body.items() if key not in ENGINE_ONLY_FIELDS}
    if model:
        out["model"] = model
    if not isinstance(out.get("prompt_cache_key"), str) or not out["prompt_cache_key"]:
        messages = out.get("messages")
        out["prompt_cache_key"] = cache_key or prefix_cache_key(messages if isinstance(messages, Sequence) else [])
    return out
