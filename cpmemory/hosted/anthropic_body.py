"""OpenAI-style chat bodies to Anthropic's Messages API and back, with ``cache_control`` breakpoints. Pure; no IO.

Anthropic caches a prompt only up to the content blocks marked ``cache_control`` (at most four per request); a
breakpoint also finds an entry written at an earlier block boundary, looking back a bounded number of blocks. A
prefix shorter than the model's minimum is not cached. cpmemory's prompts are prefix-stable (system, the history
as sent, then the new user message with its blocks before the question), so the breakpoints go where a later
request will find the same bytes:

- ``system``: the end of the system prompt (every turn and every stateless call of a tenant share it);
- ``history``: the end of the history (the last message before the new user message);
- ``context``: the end of the new user message's context, before its question section (a call that retrieves the
  same blocks in the same order finds it);
- ``final``: the end of the prompt (the next turn of the conversation starts with it).

Placements are named (:data:`CPMEMORY_PLACEMENT`; :data:`CONVERSATION_PLACEMENT` is the system-and-last-message
pattern of Anthropic's multi-turn example, the baseline of ``bench hosted``); a request never carries more than
:data:`MAX_BREAKPOINTS`, and two names that fall on one block make one breakpoint.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cpmemory.errors import InvalidInputError

__all__ = [
    "CONVERSATION_PLACEMENT", "CPMEMORY_PLACEMENT", "MAX_BREAKPOINTS", "QUESTION_MARKER", "anthropic_request",
    "count_breakpoints", "openai_response",
]

MAX_BREAKPOINTS = 4
"""Anthropic's limit of ``cache_control`` blocks per request."""

CPMEMORY_PLACEMENT = ("system", "history", "context", "final")
CONVERSATION_PLACEMENT = ("system", "final")
PLACEMENT_PRIORITY = ("final", "history", "context", "system")
"""Which breakpoints are kept first when a placement names more than the limit."""

QUESTION_MARKER = "\n\nQuestion: "
"""Where cpmemory's user message turns from its context to its question (cpmemory.core.annotations)."""

_STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}
_PASSED = ("temperature", "top_p", "top_k", "metadata")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Text content blocks of one OpenAI message's content (a string or text parts)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if isinstance(content, Sequence):
        out = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidInputError(f"{where}: only text content is translated to Anthropic")
            if part["text"]:
                out.append({"type": "text", "text": part["text"]})
        return out
    if content is None:
        return []
    raise InvalidInputError(f"{where}: content must be a string or a list of text parts")


def _split_question(block: dict[str, Any]) -> list[dict[str, Any]]:
    text = block["text"]
    at = text.rfind(QUESTION_MARKER)
    if at <= 0:
        return [block]
    return [{"type": "text", "text": text[:at]}, {"type": "text", "text": text[at:]}]


def _messages(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, Anthropic messages) of an OpenAI body; consecutive messages of one role are merged."""
    raw = body.get("messages")
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or not raw:
        raise InvalidInputError("messages must be a non-empty list")
    system: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(raw):
        if not isinstance(message, Mapping):
            raise InvalidInputError(f"messages[{index}] must be an object")
        role = message.get("role")
        blocks = _blocks(message.get("content"), f"messages[{index}]")
        if role in ("system", "developer"):
            if messages:
                raise InvalidInputError(f"messages[{index}]: a system message after the conversation started")
            system.extend(blocks)
            continue
        if role not in ("user", "assistant"):
            raise InvalidInputError(f"messages[{index}]: role {role!r} is not translated to Anthropic")
        if not blocks:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": blocks})
    if not messages or messages[0]["role"] != "user":
        raise InvalidInputError("the conversation must start with a user message")
    return system, messages


def _targets(system: list[dict[str, Any]], messages: list[dict[str, Any]], placement: Sequence[str]
             ) -> list[dict[str, Any]]:
    """The blocks that get a breakpoint, at most MAX_BREAKPOINTS, each once."""
    final = messages[-1]
    if final["role"] == "user":
        final["content"] = [piece for block in final["content"] for piece in _split_question(block)]
    found: dict[str, dict[str, Any]] = {}
    if system:
        found["system"] = system[-1]
    if len(messages) > 1:
        found["history"] = messages[-2]["content"][-1]
    if final["role"] == "user" and len(final["content"]) > 1:
        found["context"] = final["content"][-2]
    found["final"] = final["content"][-1]
    chosen: list[dict[str, Any]] = []
    for name in PLACEMENT_PRIORITY:
        block = found.get(name)
        if name in placement and block is not None and all(block is not other for other in chosen):
            chosen.append(block)
        if len(chosen) == MAX_BREAKPOINTS:
            break
    return chosen


def anthropic_request(
    body: Mapping[str, Any], *, model: str | None = None, placement: Sequence[str] = CPMEMORY_PLACEMENT,
    ttl: str | None = None, default_max_tokens: int = 1024,
) -> dict[str, Any]:
    """The Messages API body of an OpenAI chat body, with ``cache_control`` on the blocks ``placement`` names.

    Args:
        body: an OpenAI chat completion body (text content only; ``n`` 1; no tools).
        model: replaces the body's model when given.
        placement: breakpoint names (see the module docstring); an empty placement sends none.
        ttl: ``"5m"`` or ``"1h"``; None leaves the provider's default lifetime.
        default_max_tokens: ``max_tokens`` when the body has neither it nor ``max_completion_tokens``.

    Raises:
        InvalidInputError: content, roles or options Anthropic cannot take as translated here.
    """
    unknown = [name for name in placement if name not in CPMEMORY_PLACEMENT]
    if unknown:
        raise InvalidInputError(f"unknown breakpoint placement {unknown}; choose from {list(CPMEMORY_PLACEMENT)}")
    if ttl not in (None, "5m", "1h"):
        raise InvalidInputError(f"ttl must be '5m' or '1h', got {ttl!r}")
    if body.get("tools") or body.get("functions"):
        raise InvalidInputError("tools are not translated to Anthropic by cpmemory's hosted adapter")
    if body.get("n") not in (None, 1):
        raise InvalidInputError("Anthropic answers one choice per request (n must be 1)")
    system, messages = _messages(body)
    marker: dict[str, Any] = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    for block in _targets(system, messages, placement):
        block["cache_control"] = dict(marker)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens
    out: dict[str, Any] = {"model": model or body.get("model"), "max_tokens": max_tokens, "messages": messages}
    if system:
        out["system"] = system
    for name in _PASSED:
        if body.get(name) is not None:
            out[name] = body[name]
    stop = body.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    return out


def count_breakpoints(request: Mapping[str, Any]) -> int:
    """How many blocks of an Anthropic body carry ``cache_control`` (system, messages, tools). Pure."""
    blocks: list[Any] = list(request.get("tools") or [])
    system = request.get("system")
    if isinstance(system, list):
        blocks.extend(system)
    for message in request.get("messages") or []:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            blocks.extend(content)
    return sum(1 for block in blocks if isinstance(block, Mapping) and block.get("cache_control"))


def openai_response(message: Mapping[str, Any], *, created: int) -> dict[str, Any]:
    """An OpenAI chat completion from an Anthropic message: its text, finish reason and usage. The usage keeps
    Anthropic's cache counts beside OpenAI's (``prompt_tokens`` counts every input token, ``cached_tokens`` the
    ones read). Pure."""
    text = "".join(block.get("text", "") for block in message.get("content") or []
                   if isinstance(block, Mapping) and block.get("type") == "text")
    found = message.get("usage")
    usage: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    read = int(usage.get("cache_read_input_tokens") or 0)
    written = int(usage.get("cache_creation_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + read + written
    output = int(usage.get("output_tokens") or 0)
    openai_usage: dict[str, Any] = {
        "prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": read},
        "cache_read_input_tokens": read, "cache_creation_input_tokens": written,
    }
    if isinstance(usage.get("cache_creation"), Mapping):
        openai_usage["cache_creation"] = dict(usage["cache_creation"])
    return {
        "id": str(message.get("id") or ""), "object": "chat.completion", "created": created,
        "model": str(message.get("model") or ""),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": _STOP_REASONS.get(str(message.get("stop_reason")), "stop")}],
        "usage": openai_usage,
    }
