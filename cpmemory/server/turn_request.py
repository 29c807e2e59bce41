"""A chat request as a cpmemory turn: the request split into system prompt, history and query, and the small
helpers that name a turn's engine request and describe it in the response (pure; no IO)."""
from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

from cpmemory.core.blocks import Block, to_block
from cpmemory.engines.openai_wire import parse_usage
from cpmemory.errors import InvalidInputError
from cpmemory.routing.router import conversation_affinity_key
from cpmemory.server.schemas import ChatCompletionRequest, ChatMessage
from cpmemory.session.turns import BlockDecision, PreparedTurn


@dataclass(frozen=True, slots=True)
class TurnInput:
    """What the facade's ``prepare`` receives, derived from the chat request."""

    conversation_id: str
    query: str
    blocks: tuple[Block, ...]
    system_prompt: str | None
    history: tuple[dict[str, Any], ...] | None



def message_text(message: ChatMessage) -> str:
    """Return a message's text (text parts joined by line breaks); list content must be text parts only
    (InvalidInputError otherwise)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidInputError("cpmemory turns accept text content only")
        texts.append(part["text"])
    return "\n".join(texts)


def request_chars(request: ChatCompletionRequest, turn: TurnInput | None) -> int:
    """Characters of a request's messages and blocks, before it is prepared (what the token estimate counts)."""
    chars = sum(len(str(message.content or "")) for message in request.messages)
    if turn is not None:
        chars += sum(len(block.text) for block in turn.blocks)
    return chars


def turn_input(request: ChatCompletionRequest, header_conversation: str | None) -> TurnInput:
    """Split a chat request into system prompt, history and query for ``prepare``. Pure.

    Leading system messages form the system prompt. The query is ``cpmemory.query`` when given, else the last
    message's text when it is a user message. Every other message is the client's own history, sent as given
    (every field: tool calls, tool call ids, names, content parts); None when there is none (the stored transcript
    is used). A message is never dropped: with ``cpmemory.query`` a final user message stays in the history.
    Blocks are passed as given (repeated ids are resolved by the facade, one decision per block).

    Raises:
        InvalidInputError: no conversation id, no query, or non-text content in the system prompt or the query.
    """
    extension = request.cpmemory
    conversation_id = (extension.conversation_id if extension else None) or header_conversation
    if not conversation_id:
        raise InvalidInputError("a cpmemory turn needs cpmemory.conversation_id or X-Cpmemory-Conversation")
    messages = list(request.messages)
    system_parts: list[str] = []
    while messages and messages[0].role == "system":
        system_parts.append(message_text(messages.pop(0)))
    query = extension.query if extension else None
    if query is None and messages and messages[-1].role == "user":
        query = message_text(messages.pop())
    if query is None:
        raise InvalidInputError("a cpmemory turn needs a final user message or cpmemory.query")
    history = tuple(message.model_dump(exclude_unset=True) for message in messages)
    blocks = [to_block(block.model_dump()) for block in extension.blocks] if extension else []
    return TurnInput(
        conversation_id, query, tuple(blocks), "\n\n".join(system_parts) or None, history or None
    )


def answer_usage(usage: Any) -> tuple[int | None, int]:
    """(prompt tokens or None, completion tokens or 0) of an engine's ``usage`` object (``parse_usage``)."""
    parsed = parse_usage(usage)
    return parsed.prompt_tokens, parsed.completion_tokens or 0


def has_history(turn: TurnInput, prepared: PreparedTurn) -> bool:
    """Whether a turn carries conversation history (a later turn, or the client's own transcript)."""
    return bool(turn.history) or prepared.turn > 1


def engine_request_id(prepared: PreparedTurn) -> str:
    """The request id sent to the engine: the turn's index leaf id, or a fresh one when nothing was indexed."""
    if prepared.request_id:
        return prepared.request_id
    reservation = prepared.reservation_id or uuid.uuid4().hex
    return f"cpm-{reservation}"


def decision_dict(item: BlockDecision) -> dict[str, Any]:
    """A BlockDecision as a JSON-ready dict."""
    return {
        "block_id": str(item.block_id), "label": str(item.label), "status": str(item.status),
        "original_rank": int(item.original_rank),
        "prompt_position": None if item.prompt_position is None else int(item.prompt_position),
        "saved_chars": int(item.saved_chars),
        "duplicate_of": item.duplicate_of,
    }


def prefix_key(tenant: str, request: ChatCompletionRequest) -> str:
    """Affinity key of a plain request: the tenant and its first message (the prefix most likely cached)."""
    first = request.messages[0]
    text = first.content if isinstance(first.content, str) else repr(first.content)
    digest = hashlib.blake2b(text[:4096].encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return conversation_affinity_key(tenant, "prefix:" + digest)
