"""LangChain Documents / messages <-> cpmemory blocks and chat messages (sans-IO).

A Document's block id is ``Document.id`` when set, else ``metadata[id_key]`` (default ``"id"``), else derived from
its content hash (see :func:`cpmemory.adapters.assign_blocks` for empty and repeated documents). Decisions are
written to a copy of each Document under ``metadata["cpmemory"]``; the inner retriever's Documents are never mutated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, convert_to_messages, convert_to_openai_messages
from langchain_core.runnables import RunnableConfig

from cpmemory.adapters import (
    BlockAssignment,
    PreparedTurnLike,
    assign_blocks,
    decision_fields,
    passthrough_fields,
    prompt_ranks,
)
from cpmemory.errors import InvalidInputError

METADATA_KEY = "cpmemory"
"""Where a Document carries what cpmemory decided for it."""


def conversation_from_config(config: RunnableConfig | Mapping[str, Any] | None, key: str) -> str | None:
    """Return ``config["configurable"][key]`` as a string (LangGraph's ``thread_id`` by default), or None."""
    configurable = (config or {}).get("configurable") or {}
    value = configurable.get(key)
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else str(value)


def _document_id(document: Document, id_key: str) -> str | None:
    raw = document.id if document.id else (document.metadata or {}).get(id_key)
    if raw is None or raw == "":
        return None
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise InvalidInputError(f"document id must be a string, got {type(raw).__name__}")
    return str(raw)


def documents_to_blocks(documents: Sequence[Document], id_key: str = "id") -> BlockAssignment:
    """Make blocks from Documents in relevance order. Pure; O(n).

    Raises:
        InvalidInputError: an item is not a Document, or its id is neither a string nor an int.
    """
    entries = []
    for rank, document in enumerate(documents):
        if not isinstance(document, Document):
            raise InvalidInputError(
                f"retriever result #{rank} is a {type(document).__name__}, not a Document"
            )
        entries.append((_document_id(document, id_key), document.page_content, None))
    return assign_blocks(entries)


def _with_fields(document: Document, fields: Mapping[str, Any]) -> Document:
    return document.model_copy(update={"metadata": {**(document.metadata or {}), METADATA_KEY: dict(fields)}})


def annotate_prepared(
    documents: Sequence[Document], assignment: BlockAssignment, turn: PreparedTurnLike
) -> list[Document]:
    """Return copies of ``documents`` in prompt order, each with its decision in ``metadata["cpmemory"]``. Pure.

    Documents placed in the prompt come first (prompt order), then references (relevance order), then documents
    not sent (empty, duplicates) in their original order. Every input Document is in the output exactly once.
    """
    by_block = {decision.original_rank: decision for decision in turn.decisions}
    item_of_block = {block: rank for rank, block in enumerate(assignment.item_block) if block is not None}
    out: list[Document] = []
    labels: dict[int, str] = {}
    for block_index in prompt_ranks([d for d in turn.decisions if d.original_rank in item_of_block]):
        rank = item_of_block[block_index]
        fields = {
            **decision_fields(turn, by_block[block_index]),
            "original_rank": rank,
            **assignment.notes[rank],
        }
        labels[rank] = fields["label"]
        out.append(_with_fields(documents[rank], fields))
    for block_index in sorted(set(item_of_block) - set(by_block)):
        rank = item_of_block[block_index]
        out.append(
            _with_fields(
                documents[rank], {**passthrough_fields(rank, "no decision"), **assignment.notes[rank]}
            )
        )
    shared = {
        "conversation_id": turn.conversation_id,
        "turn": turn.turn,
        "reservation_id": turn.reservation_id,
    }
    for rank, block_index in enumerate(assignment.item_block):
        if block_index is None:
            note = assignment.notes[rank]
            label = labels.get(note.get("duplicate_of", -1))
            fields = {**shared, "label": label, "original_rank": rank, "prompt_position": None, **note}
            out.append(_with_fields(documents[rank], fields))
    return out


def annotate_passthrough(
    documents: Sequence[Document], assignment: BlockAssignment, reason: str
) -> list[Document]:
    """Return copies of ``documents`` in their original order, each marked ``passthrough``. Pure."""
    out = []
    for rank, document in enumerate(documents):
        fields = {**passthrough_fields(rank, reason), **assignment.notes[rank]}
        if assignment.item_block[rank] is None:
            fields["prompt_position"] = None
        out.append(_with_fields(document, fields))
    return out


def relevance_order(documents: Sequence[Document]) -> list[Document]:
    """Return ``documents`` in their original relevance order (undoing a CpMemoryRetriever's reordering). Pure."""

    def rank(item: tuple[int, Document]) -> tuple[int, int]:
        fields = (item[1].metadata or {}).get(METADATA_KEY) or {}
        original = fields.get("original_rank")
        return (original if isinstance(original, int) else item[0], item[0])

    return [document for _, document in sorted(enumerate(documents), key=rank)]


def messages_to_dicts(history: Sequence[BaseMessage] | None) -> list[dict[str, Any]] | None:
    """Convert LangChain messages to OpenAI-style dicts, every field kept (tool calls, tool call ids, names,
    content parts). Pure; raises InvalidInputError for an item that is not a LangChain message."""
    if history is None:
        return None
    for message in history:
        if not isinstance(message, BaseMessage):
            raise InvalidInputError(f"history items must be LangChain messages, got {type(message).__name__}")
    return [dict(message) for message in convert_to_openai_messages(list(history))]


def dicts_to_messages(messages: Sequence[Mapping[str, Any]]) -> list[BaseMessage]:
    """Convert OpenAI-style dicts (the facade's messages) to LangChain messages: an assistant's tool calls and a
    tool message's ``tool_call_id`` survive the round trip with :func:`messages_to_dicts`. Pure."""
    return list(convert_to_messages([dict(message) for message in messages]))


def same_documents(assignment: BlockAssignment, turn: PreparedTurnLike) -> bool:
    """True when the blocks of ``assignment`` are exactly the blocks ``turn`` was prepared with, ids and texts in the
    same relevance order: then the turn's prompt (its order annotation included) is the prompt of these documents.

    ``assignment`` is made from the documents put back in relevance order (:func:`relevance_order`), so the order
    the documents are *given* in does not matter; their relevance order does. The same set of blocks in another
    relevance order is not the same prompt: e.g. a filter dropped the first of two documents repeating an id and a
    text, so the text now ranks where its repeat did (the turn's prompt would show it in the old place with no order
    annotation). Pure; O(n log n).
    """
    given = [(block.id, block.content_hash) for block in assignment.blocks]
    prepared = [
        (d.block_id, getattr(d, "content_hash", ""))
        for d in sorted(turn.decisions, key=lambda decision: decision.original_rank)
    ]
    return given == prepared


@dataclass(frozen=True, slots=True)
class PromptInput:
    """The input of the prompt runnable, validated."""

    documents: tuple[Document, ...]
    question: str
    history: tuple[BaseMessage, ...] | None

    @classmethod
    def parse(cls, value: Any) -> PromptInput:
        """Validate ``{"documents", "question", "history"?}``. Raises InvalidInputError."""
        if not isinstance(value, Mapping):
            raise InvalidInputError(f"prompt input must be a dict, got {type(value).__name__}")
        question = value.get("question")
        if not isinstance(question, str):
            raise InvalidInputError("prompt input needs a string 'question'")
        documents = value.get("documents") or []
        history = value.get("history")
        if not isinstance(documents, (list, tuple)):
            raise InvalidInputError(f"'documents' must be a list, got {type(documents).__name__}")
        for rank, document in enumerate(documents):
            if not isinstance(document, Document):
                raise InvalidInputError(f"document #{rank} is a {type(document).__name__}, not a Document")
        if history is not None and not (
            isinstance(history, (list, tuple)) and all(isinstance(message, BaseMessage) for message in history)
        ):
            raise InvalidInputError("'history' must be a list of LangChain messages")
        return cls(tuple(documents), question, None if history is None else tuple(history))
