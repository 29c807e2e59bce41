"""``CpMemoryRetriever``: a LangChain retriever that reorders / de-duplicates another retriever's Documents.

    retriever = CpMemoryRetriever(retriever=vector_store.as_retriever(), memory=CpMemory())
    docs = retriever.invoke("question", config={"configurable": {"thread_id": "chat-42"}})
    messages = retriever.prompt().invoke({"documents": docs, "question": "question"}, config)
    answer = model.invoke(messages)
    retriever.commit(answer, config)

The conversation is ``config["configurable"][conversation_key]`` (``"thread_id"``, LangGraph's convention, by
default; inside a LangGraph node the node's config is picked up without passing it). Each returned Document is a
copy carrying ``metadata["cpmemory"]`` (status, label, original_rank, prompt_position, ...), in prompt order.
Without a conversation id the Documents pass through in their original order, marked ``passthrough``, with a
:class:`~cpmemory.adapters.PassthroughWarning`; nothing is de-duplicated and nothing is ever dropped.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import ensure_config
from pydantic import ConfigDict, Field, PrivateAttr

from cpmemory.adapters import PassthroughWarning, online_order, pending_limit
from langchain_cpmemory.documents import (
    annotate_passthrough,
    annotate_prepared,
    conversation_from_config,
    documents_to_blocks,
)
from langchain_cpmemory.turns import (
    DEFAULT_CONVERSATION_KEY,
    SharedPendingTurns,
    TurnKeeper,
    acall_facade,
    call_facade,
    warn_no_prompt,
)

NO_CONVERSATION_REASON = "no conversation id in config['configurable']"


def _default_memory() -> Any:
    from cpmemory import CpMemory

    return CpMemory()


class CpMemoryRetriever(TurnKeeper, BaseRetriever):
    """Wrap ``retriever``; its Documents come back in prompt order with cpmemory's decisions in their metadata.

    Attributes:
        retriever: the inner retriever (any ``BaseRetriever``); its Documents are never mutated.
        memory: a ``cpmemory.CpMemory`` (sync and async calls) or ``AsyncCpMemory`` (async calls only).
        conversation_key: the ``configurable`` key naming the conversation (default ``"thread_id"``).
        id_key: the metadata key holding a Document's id when ``Document.id`` is unset.
        tenant: the cpmemory tenant of this retriever's conversations.
        system_prompt: placed first in every prepared turn's messages.
        max_prompt_tokens: the token budget of every prepared turn's prompt (None: the facade's own).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    memory: Any = Field(default_factory=_default_memory)
    conversation_key: str = DEFAULT_CONVERSATION_KEY
    id_key: str = "id"
    tenant: str = "default"
    system_prompt: str | None = None
    max_prompt_tokens: int | None = None
    _pending: SharedPendingTurns = PrivateAttr(default=None)  # type: ignore[assignment]
    _turns_prepared: int = PrivateAttr(default=0)
    _warned_no_prompt: bool = PrivateAttr(default=False)

    def model_post_init(self, context: Any, /) -> None:
        """Size the pending turns by the facade's ``max_pending_turns`` (the oldest beyond it are aborted)."""
        super().model_post_init(context)
        self._pending = SharedPendingTurns(pending_limit(self.memory))

    def _check_prompt(self) -> None:
        """Warn once when turns are prepared or committed and no prompt runnable shares them (from the second
        prepared turn on: ``retriever.prompt()`` may be made after the first retrieval)."""
        if self._pending.prompt_attached or self._warned_no_prompt or self._turns_prepared < 2:
            return
        self._warned_no_prompt = True
        warn_no_prompt(type(self).__name__)

    def invoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        """Retrieve, then reorder / de-duplicate for the run's conversation (see the module docstring)."""
        config = ensure_config(config)
        kwargs.setdefault("conversation_id", conversation_from_config(config, self.conversation_key))
        return super().invoke(input, config, **kwargs)

    async def ainvoke(
        self, input: str, config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        """Async :meth:`invoke`."""
        config = ensure_config(config)
        kwargs.setdefault("conversation_id", conversation_from_config(config, self.conversation_key))
        return await super().ainvoke(input, config, **kwargs)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        conversation_id: str | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        # Other keyword arguments (``k``...) are the inner retriever's: it decides what is retrieved, the wrapper
        # only reorders and de-duplicates what it returns (never drops a Document).
        documents = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        assignment = documents_to_blocks(documents, self.id_key)
        if conversation_id is None:
            return self._passthrough(documents, assignment)
        turn = call_facade(
            self.memory, "prepare", conversation_id, query, list(assignment.blocks), **self._options()
        )
        for stale in self._replace(conversation_id, turn):
            call_facade(self.memory, "abort", stale)
        self._turns_prepared += 1
        self._check_prompt()
        return annotate_prepared(documents, assignment, turn)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        conversation_id: str | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        documents = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        assignment = documents_to_blocks(documents, self.id_key)
        if conversation_id is None:
            return self._passthrough(documents, assignment)
        blocks = list(assignment.blocks)
        turn = await acall_facade(self.memory, "prepare", conversation_id, query, blocks, **self._options())
        for stale in self._replace(conversation_id, turn):
            await acall_facade(self.memory, "abort", stale)
        self._turns_prepared += 1
        self._check_prompt()
        return annotate_prepared(documents, assignment, turn)

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"tenant": self.tenant, "system_prompt": self.system_prompt}
        if self.max_prompt_tokens is not None:
            options["max_prompt_tokens"] = self.max_prompt_tokens
        return options

    def _passthrough(self, documents: Sequence[Document], assignment: Any) -> list[Document]:
        warnings.warn(
            f"CpMemoryRetriever: no '{self.conversation_key}' in config['configurable']; "
            "documents ordered online, nothing de-duplicated or recorded for a conversation",
            PassthroughWarning,
            stacklevel=4,
        )
        annotated = annotate_passthrough(documents, assignment, NO_CONVERSATION_REASON)
        ordered = online_order(self.memory, list(assignment.blocks), self.tenant)
        position = {block.id: i for i, block in enumerate(ordered)}

        def prompt_rank(rank: int) -> int:
            block = assignment.item_block[rank]
            return position.get(assignment.blocks[block].id, len(ordered)) if block is not None else len(ordered)

        return [annotated[rank] for rank in sorted(range(len(annotated)), key=lambda rank: (prompt_rank(rank), rank))]

    def prompt(self) -> Any:
        """Return a :class:`CpMemoryPromptRunnable` sharing this retriever's facade and pending turns."""
        from langchain_cpmemory.prompt import CpMemoryPromptRunnable

        return CpMemoryPromptRunnable(
            self.memory,
            pending=self._pending,
            conversation_key=self.conversation_key,
            id_key=self.id_key,
            tenant=self.tenant,
            system_prompt=self.system_prompt,
            max_prompt_tokens=self.max_prompt_tokens,
        )
