"""``CpMemoryPromptRunnable``: ``{documents, question, history}`` -> chat messages with prefix-stable context.

    chain = (
        {"documents": retriever, "question": RunnablePassthrough()}
        | retriever.prompt()          # list[BaseMessage]
        | chat_model
        | retriever.committer()       # records the answer for the conversation's next turns
    )
    chain.invoke("question", config={"configurable": {"thread_id": "chat-42"}})

Which prompt is built:

1. The documents a :class:`~langchain_cpmemory.retriever.CpMemoryRetriever` sharing this runnable's pending
   turns returned (same ids and texts in the same relevance order, given in any order), with no ``history`` given:
   the turn the retriever prepared is used as is (no second prepare). Documents changed, dropped or re-ranked in
   between (a compressor, a filter) are case 2.
2. Otherwise, with a conversation id in the config: the documents (put back in their relevance order) are
   prepared here, with ``history`` (LangChain messages) when given -- references then point only at text in it --
   or the conversation's stored transcript when not. A turn the retriever prepared for the conversation is aborted.
3. Without a conversation id: every document in full, in the given order (a
   :class:`~cpmemory.adapters.PassthroughWarning`); nothing is recorded.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import ensure_config

from cpmemory.adapters import (
    PassthroughWarning,
    PendingTurns,
    facade_system_prompt,
    online_order,
    passthrough_messages,
    pending_limit,
)
from langchain_cpmemory.documents import (
    METADATA_KEY,
    PromptInput,
    annotate_prepared,
    conversation_from_config,
    dicts_to_messages,
    documents_to_blocks,
    messages_to_dicts,
    relevance_order,
    same_documents,
)
from langchain_cpmemory.turns import (
    DEFAULT_CONVERSATION_KEY,
    SharedPendingTurns,
    TurnKeeper,
    acall_facade,
    call_facade,
)

SENT_DOCUMENTS_KEPT = 1024
"""Conversations whose last prompt's documents :meth:`CpMemoryPromptRunnable.sent_documents` keeps (oldest dropped)."""


class CpMemoryPromptRunnable(TurnKeeper, Runnable[Mapping[str, Any], list[BaseMessage]]):
    """Build a turn's chat messages through cpmemory (see the module docstring for the three cases).

    Args:
        memory: a ``cpmemory.CpMemory`` or ``AsyncCpMemory``; None builds a ``CpMemory``.
        pending: pending turns to share with a retriever (``CpMemoryRetriever.prompt()`` passes its own); None
            makes a set bounded by the facade's ``max_pending_turns`` (the oldest beyond it are aborted).
        conversation_key: the ``configurable`` key naming the conversation (default ``"thread_id"``).
        id_key: the metadata key holding a Document's id when ``Document.id`` is unset.
        tenant: the cpmemory tenant.
        system_prompt: placed first in the messages.
        max_prompt_tokens: the token budget of the prompts prepared here (None: the facade's own).
    """

    def __init__(
        self,
        memory: Any = None,
        *,
        pending: PendingTurns | None = None,
        conversation_key: str = DEFAULT_CONVERSATION_KEY,
        id_key: str = "id",
        tenant: str = "default",
        system_prompt: str | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        if memory is None:
            from cpmemory import CpMemory

            memory = CpMemory()
        self.memory = memory
        self._pending = pending if pending is not None else PendingTurns(pending_limit(memory))
        if isinstance(self._pending, SharedPendingTurns):
            self._pending.prompt_attached = True  # the retriever's turns reach a cpmemory prompt
        self._sent: dict[str, list[Document]] = {}
        self._sent_lock = threading.Lock()
        self.conversation_key = conversation_key
        self.id_key = id_key
        self.tenant = tenant
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens

    def _reusable(self, parsed: PromptInput, conversation: str | None) -> Any | None:
        """The retriever's pending turn when ``parsed`` carries exactly its blocks (same ids and texts in the same
        relevance order, see :func:`~langchain_cpmemory.documents.same_documents`; the documents themselves may come
        in any order) and no history; documents a compressor or filter changed get a prompt of their own."""
        if conversation is None or parsed.history is not None:
            return None
        turn = self.pending.get(conversation)
        if turn is None:
            return None
        reservations = {
            (doc.metadata or {}).get(METADATA_KEY, {}).get("reservation_id") for doc in parsed.documents
        }
        if reservations != {turn.reservation_id}:
            return None
        assignment = documents_to_blocks(relevance_order(parsed.documents), self.id_key)
        return turn if same_documents(assignment, turn) else None

    def _start(
        self, input: Mapping[str, Any], config: RunnableConfig | None
    ) -> tuple[PromptInput, str | None, Any | None]:
        """Parse the input: (input, conversation id or None, the retriever's reusable turn or None)."""
        parsed = PromptInput.parse(input)
        conversation = conversation_from_config(ensure_config(config), self.conversation_key)
        return parsed, conversation, self._reusable(parsed, conversation)

    def _prepare_call(
        self, parsed: PromptInput, conversation: str
    ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """Positional and keyword arguments of the facade's ``prepare`` for this input, and the block assignment."""
        assignment, options = self._arguments(parsed)
        return (conversation, parsed.question, list(assignment.blocks)), options, assignment

    def _note_sent(self, conversation: str, parsed: PromptInput, turn: Any, assignment: Any | None) -> None:
        """Remember which documents the conversation's prompt was built from, in prompt order, annotated with what
        was sent. A reused turn (``assignment`` None) has the same blocks in the same order as these documents, so
        their annotations come from it too (a document the retriever marked a duplicate of one dropped since is then
        the one sent)."""
        ordered = relevance_order(parsed.documents)
        if assignment is None:
            assignment = documents_to_blocks(ordered, self.id_key)
        documents = annotate_prepared(ordered, assignment, turn)
        with self._sent_lock:
            self._sent.pop(conversation, None)
            self._sent[conversation] = documents
            while len(self._sent) > SENT_DOCUMENTS_KEPT:
                self._sent.pop(next(iter(self._sent)))

    def sent_documents(
        self, config: RunnableConfig | None = None, *, conversation_id: str | None = None
    ) -> list[Document]:
        """The documents the conversation's last prompt was built from, in prompt order, each with
        ``metadata["cpmemory"]`` describing what was sent (a retriever's Documents changed by a compressor or a
        filter before the prompt no longer describe it: the prompt was prepared again). Empty when none."""
        conversation = conversation_id or self.conversation_id(config)
        with self._sent_lock:
            return list(self._sent.get(conversation or "", []))

    def _arguments(self, parsed: PromptInput) -> tuple[Any, dict[str, Any]]:
        assignment = documents_to_blocks(relevance_order(parsed.documents), self.id_key)
        options = {
            "history": messages_to_dicts(parsed.history),
            "tenant": self.tenant,
            "system_prompt": self.system_prompt,
        }
        if self.max_prompt_tokens is not None:
            options["max_prompt_tokens"] = self.max_prompt_tokens
        return assignment, options

    def _passthrough(self, parsed: PromptInput) -> list[BaseMessage]:
        warnings.warn(
            f"CpMemoryPromptRunnable: no '{self.conversation_key}' in config['configurable']; "
            "documents ordered online, every one sent in full, nothing recorded for a conversation",
            PassthroughWarning,
            stacklevel=3,
        )
        assignment = documents_to_blocks(parsed.documents, self.id_key)
        messages = passthrough_messages(
            parsed.question,
            online_order(self.memory, assignment.blocks, self.tenant),
            history=messages_to_dicts(parsed.history),
            system_prompt=facade_system_prompt(self.memory, self.system_prompt),
        )
        return dicts_to_messages(messages)

    def invoke(
        self, input: Mapping[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[BaseMessage]:
        """Return the chat messages of the run's turn (prepares one unless the retriever already did)."""
        parsed, conversation, turn = self._start(input, config)
        if turn is None:
            if conversation is None:
                return self._passthrough(parsed)
            args, options, assignment = self._prepare_call(parsed, conversation)
            turn = call_facade(self.memory, "prepare", *args, **options)
            for stale in self._replace(conversation, turn):
                call_facade(self.memory, "abort", stale)
            self._note_sent(conversation, parsed, turn, assignment)
        elif conversation is not None:
            self._note_sent(conversation, parsed, turn, None)
        return dicts_to_messages(turn.messages)

    async def ainvoke(
        self, input: Mapping[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[BaseMessage]:
        """Async :meth:`invoke`."""
        parsed, conversation, turn = self._start(input, config)
        if turn is None:
            if conversation is None:
                return self._passthrough(parsed)
            args, options, assignment = self._prepare_call(parsed, conversation)
            turn = await acall_facade(self.memory, "prepare", *args, **options)
            for stale in self._replace(conversation, turn):
                await acall_facade(self.memory, "abort", stale)
            self._note_sent(conversation, parsed, turn, assignment)
        elif conversation is not None:
            self._note_sent(conversation, parsed, turn, None)
        return dicts_to_messages(turn.messages)
