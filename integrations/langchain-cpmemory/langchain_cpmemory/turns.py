"""The two-phase turn behind the LangChain adapters: prepare, then commit the answer (or abort).

A retriever or prompt runnable prepares a turn per conversation and keeps it in a :class:`PendingTurns` that it
shares with the other adapters of the same chain; :class:`TurnKeeper` commits or aborts it by conversation id (taken
from the run's config, like everything else). The facade may be sync (``CpMemory``) or async (``AsyncCpMemory``):
the sync path needs a sync facade; the async path awaits an async one or runs a sync one in an executor.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.runnables.config import ensure_config, run_in_executor

from cpmemory.adapters import DEFAULT_PENDING_LIMIT, PendingTurns
from cpmemory.errors import CpMemoryError, InvalidInputError, ReservationError, UnknownReservationError
from langchain_cpmemory.documents import conversation_from_config

DEFAULT_CONVERSATION_KEY = "thread_id"


class NoPromptWarning(UserWarning):
    """Warned once per retriever: its turns are prepared, but no ``retriever.prompt()`` builds the prompt.

    A prompt template of one's own shows every retrieved document in full, so nothing is de-duplicated (the
    documents are only reordered). Build the messages with ``retriever.prompt()`` and record the answer with
    ``retriever.committer()`` (or ``commit``).
    """


class SharedPendingTurns(PendingTurns):
    """The pending turns a retriever shares with the prompt runnables made from it; knows whether one exists."""

    __slots__ = ("prompt_attached",)

    def __init__(self, limit: int = DEFAULT_PENDING_LIMIT) -> None:
        super().__init__(limit)
        self.prompt_attached = False


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside LangChain and this package (where the user called)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(
        ("langchain_core", "langchain_cpmemory")
    ):
        frame, level = frame.f_back, level + 1
    return level


def warn_no_prompt(owner: str) -> None:
    """Warn (the caller warns once) that a retriever's turns reach no cpmemory prompt: nothing is de-duplicated."""
    warnings.warn(
        f"{owner}: documents are reordered, but no retriever.prompt() builds the prompt: a prompt template of your "
        "own shows every document in full, so nothing is de-duplicated. Build the messages with retriever.prompt() "
        "and record the answer with retriever.committer() (or retriever.commit). Warned once per retriever.",
        NoPromptWarning,
        stacklevel=_user_stacklevel(),
    )


def is_async_facade(memory: Any) -> bool:
    """True when ``memory.prepare`` is a coroutine function (an ``AsyncCpMemory``)."""
    return inspect.iscoroutinefunction(getattr(memory, "prepare", None))


def call_facade(memory: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call a sync facade method. Raises InvalidInputError for an async facade (use the async path)."""
    if is_async_facade(memory):
        raise InvalidInputError(
            "this adapter holds an AsyncCpMemory: call ainvoke / acommit, or pass a CpMemory"
        )
    return getattr(memory, method)(*args, **kwargs)


async def acall_facade(memory: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Await an async facade method, or run a sync one in the default executor."""
    if is_async_facade(memory):
        return await getattr(memory, method)(*args, **kwargs)
    return await run_in_executor(None, getattr(memory, method), *args, **kwargs)


def answer_text(answer: Any) -> str:
    """The text of a model answer: a string, a message's text, or ``{"answer": ...}`` / ``{"messages": [...]}``."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, BaseMessage):
        return answer.text if isinstance(answer.text, str) else str(answer.content)
    if isinstance(answer, Mapping):
        if "answer" in answer:
            return answer_text(answer["answer"])
        if answer.get("messages"):
            return answer_text(answer["messages"][-1])
    raise InvalidInputError(f"cannot read an answer from {type(answer).__name__}")


class TurnKeeper:
    """Commit or abort the pending turn of a conversation; shared by the retriever and the prompt runnable.

    Subclasses provide the attributes ``memory`` (the facade), ``conversation_key`` (str) and ``_pending``
    (a PendingTurns).
    """

    @property
    def pending(self) -> PendingTurns:
        """Turns prepared and not yet committed, by conversation id (shared with the chain's other adapters)."""
        return self._pending  # type: ignore[attr-defined,no-any-return]

    def conversation_id(self, config: RunnableConfig | None = None) -> str | None:
        """Return the conversation id of a run (``config["configurable"][conversation_key]``), or None.

        Inside a LangGraph node or an LCEL chain the current run's config is used when ``config`` is None.
        """
        return conversation_from_config(ensure_config(config), self.conversation_key)

    def _pending_turn(self, config: RunnableConfig | None, conversation_id: str | None) -> tuple[str, Any] | None:
        conversation = conversation_id or self.conversation_id(config)
        if conversation is None:
            return None
        turn = self.pending.get(conversation)
        return None if turn is None else (conversation, turn)

    def _finished(self, conversation: str, turn: Any, error: BaseException | None = None) -> None:
        """Drop the pending turn after its commit or abort, or a final error (the reservation is gone); after any
        other error (bad answer, store down) it stays pending, so the commit can be retried or the turn aborted."""
        if error is None or isinstance(error, ReservationError):
            self.pending.discard(conversation, turn)

    def commit(
        self, answer: Any, config: RunnableConfig | None = None, *, conversation_id: str | None = None
    ) -> int:
        """Record the answer for the conversation's pending turn; return the committed turn number.

        Returns 0 when the run has no conversation id (pass-through: nothing was prepared, nothing recorded).

        Raises:
            UnknownReservationError: the conversation has no pending turn.
        """
        found = self._to_commit(config, conversation_id)
        if found is None:
            return 0
        conversation, turn = found
        text = answer_text(answer)
        try:
            number = int(call_facade(self.memory, "commit", turn, text))
        except CpMemoryError as error:
            self._finished(conversation, turn, error)
            raise
        self._finished(conversation, turn)
        return number

    async def acommit(
        self, answer: Any, config: RunnableConfig | None = None, *, conversation_id: str | None = None
    ) -> int:
        """Async :meth:`commit`."""
        found = self._to_commit(config, conversation_id)
        if found is None:
            return 0
        conversation, turn = found
        text = answer_text(answer)
        try:
            number = int(await acall_facade(self.memory, "commit", turn, text))
        except CpMemoryError as error:
            self._finished(conversation, turn, error)
            raise
        self._finished(conversation, turn)
        return number

    def abort(self, config: RunnableConfig | None = None, *, conversation_id: str | None = None) -> bool:
        """Drop the conversation's pending turn (records nothing); False when none was pending."""
        found = self._pending_turn(config, conversation_id)
        if found is None:
            return False
        released = bool(call_facade(self.memory, "abort", found[1]))
        self._finished(*found)
        return released

    async def aabort(
        self, config: RunnableConfig | None = None, *, conversation_id: str | None = None
    ) -> bool:
        """Async :meth:`abort`."""
        found = self._pending_turn(config, conversation_id)
        if found is None:
            return False
        released = bool(await acall_facade(self.memory, "abort", found[1]))
        self._finished(*found)
        return released

    def committer(self) -> RunnableLambda:
        """Return a Runnable for the end of an LCEL chain: commits the answer it receives and passes it on."""

        def commit_step(answer: Any, config: RunnableConfig) -> Any:
            self.commit(answer, config)
            return answer

        async def acommit_step(answer: Any, config: RunnableConfig) -> Any:
            await self.acommit(answer, config)
            return answer

        return RunnableLambda(commit_step, afunc=acommit_step, name="cpmemory_commit")

    def _to_commit(self, config: RunnableConfig | None, conversation_id: str | None) -> tuple[str, Any] | None:
        """(conversation, its pending turn), not removed; None without a conversation id (pass-through)."""
        conversation = conversation_id or self.conversation_id(config)
        if conversation is None:
            return None
        turn = self.pending.get(conversation)
        if turn is None:
            raise UnknownReservationError(f"no pending turn for conversation {conversation!r}")
        return conversation, turn

    def _replace(self, conversation: str, turn: Any) -> list[Any]:
        """Record ``turn`` as pending; return the turns it displaced (the conversation's previous one, the oldest
        over the bound) for the caller to abort."""
        return self.pending.put(conversation, turn)
