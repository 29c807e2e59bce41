"""The first step of prepare: validate and normalise the caller's arguments into a :class:`TurnInput` (typed
errors for bad input; nothing stored yet). Repeated block ids follow :func:`cpmemory.core.blocks.resolve_blocks`."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cpmemory.core import annotations
from cpmemory.core.blocks import Block, BlockLike, resolve_blocks
from cpmemory.errors import InvalidBlockError, InvalidInputError
from cpmemory.session.config import CpMemoryConfig
from cpmemory.types import (
    ConversationKey,
    Message,
)


@dataclass(frozen=True, slots=True)
class TurnInput:
    """A validated prepare call.

    Attributes:
        blocks: the request's blocks, ids unique (``resolve_blocks``); ``items`` maps each caller item to one.
        history: the caller-given history as dedup reads it (role and text), or None (the stored transcript).
        given_history: the caller-given history as it is sent (every field of every message), or None.
    """

    key: ConversationKey
    query: str
    blocks: tuple[Block, ...]
    digests: tuple[str, ...]
    history: tuple[Message, ...] | None
    system_prompt: str
    prompt_order: tuple[str, ...] | None
    items: tuple[int, ...] = ()
    given_history: tuple[Mapping[str, Any], ...] | None = None


def _is_list_like(value: Any) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))


def _check_message(position: int, message: Any) -> Mapping[str, Any]:
    if not isinstance(message, Mapping) or not all(isinstance(key, str) for key in message):
        raise InvalidInputError(f"history[{position}] is not a mapping with string keys")
    content = message.get("content")
    if not isinstance(message.get("role"), str):
        raise InvalidInputError(f"history[{position}] needs a string 'role'")
    parts_ok = _is_list_like(content) and all(isinstance(part, Mapping) for part in content or ())
    if not (isinstance(content, str) or parts_ok or (content is None and message["role"] == "assistant")):
        raise InvalidInputError(
            f"history[{position}]: 'content' must be a string or a list of parts (null only for an assistant)"
        )
    return {key: value if isinstance(value, str) else copy.deepcopy(value) for key, value in message.items()}


def _check_history(history: Any) -> tuple[tuple[Message, ...], tuple[Mapping[str, Any], ...]]:
    """(the history as dedup reads it: role and text; the history as sent: every field, copied)."""
    if not _is_list_like(history):
        raise InvalidInputError("history must be a list of {'role', 'content', ...} messages")
    given = tuple(_check_message(position, message) for position, message in enumerate(history))
    read = tuple({"role": m["role"], "content": annotations.content_text(m.get("content"))} for m in given)
    return read, given


def _check_prompt_order(prompt_order: Any, blocks: Sequence[Block]) -> tuple[str, ...]:
    if not _is_list_like(prompt_order):
        raise InvalidInputError(f"prompt_order must be a list of block ids, got {type(prompt_order).__name__}")
    known = {block.id for block in blocks}
    out: dict[str, None] = {}
    for value in prompt_order:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or value not in known:
            raise InvalidInputError(f"prompt_order names a block that is not in the request: {value!r}")
        out[value] = None
    return tuple(out)


def make_input(
    conversation_id: str,
    query: str,
    blocks: Iterable[BlockLike],
    *,
    history: Iterable[Mapping[str, Any]] | None,
    tenant: str,
    system_prompt: str | None,
    prompt_order: Iterable[Any] | None,
    config: CpMemoryConfig,
) -> TurnInput:
    """Validate and normalise a prepare call (repeated ids: ``resolve_blocks``). Pure; raises InvalidInputError."""
    key = ConversationKey(tenant, conversation_id)
    if not isinstance(query, str):
        raise InvalidInputError(f"query must be a string, got {type(query).__name__}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise InvalidInputError("system_prompt must be a string")
    if blocks is None:
        raise InvalidBlockError("blocks must be a list (use [] for none)")
    resolved = resolve_blocks(blocks)
    order = None if prompt_order is None else _check_prompt_order(prompt_order, resolved.blocks)
    read, given = (None, None) if history is None else _check_history(history)
    return TurnInput(
        key=key,
        query=query,
        blocks=resolved.blocks,
        digests=tuple(block.content_hash for block in resolved.blocks),
        history=read,
        system_prompt=config.system_prompt if system_prompt is None else system_prompt,
        prompt_order=order,
        items=resolved.item_block,
        given_history=given,
    )
