"""Wrap a Mem0 memory so its search results are reordered and de-duplicated by cpmemory.

    from mem0 import Memory
    from mem0_cpmemory import CpMemoryMem0

    memory = CpMemoryMem0(Memory.from_config(config))
    found = memory.search("Where does Alice live?", user_id="alice", conversation_id="chat-42")
    reply = llm(memory.chat_messages("chat-42"))          # the prompt for this turn
    memory.commit(reply, conversation_id="chat-42")

``search`` returns Mem0's own shape, in prompt order, each item with a ``cpmemory`` field (status ``new`` /
``referenced`` / ``changed`` / ``partial`` / ``resent``, its ``label``, its ``original_rank``...). Every other Mem0
method passes through unchanged.

The conversation is ``conversation_id`` if given: it is cpmemory's alone and never reaches Mem0, so memories stored
per user (``user_id``) are found in every conversation. Without it, ``run_id`` (top level or in ``filters``) names
the conversation, but Mem0 also *filters* by ``run_id``: memories added without that ``run_id`` are not found. A
search whose conversation came from ``run_id`` and that found nothing warns once per wrapper
(:class:`RunIdFilterWarning`). With neither, results pass through in Mem0's order, nothing is de-duplicated, and
``chat_messages(None)`` shows every memory in full. Works with ``Memory`` / ``MemoryClient`` (sync) and
``AsyncMemory`` / ``AsyncMemoryClient`` (:class:`AsyncCpMemoryMem0`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cpmemory import Block
from cpmemory.adapters import (
    PassthroughWarning,
    PendingTurns,
    facade_system_prompt,
    online_order,
    passthrough_messages,
    pending_limit,
)
from cpmemory.errors import CpMemoryError, InvalidInputError, ReservationError, UnknownReservationError
from mem0_cpmemory.results import (
    ParsedResults,
    assemble_passthrough,
    assemble_prepared,
    parse_search_results,
)

NO_CONVERSATION_REASON = "no conversation id (pass conversation_id)"
_PASSTHROUGH_KEY = "\x00passthrough"  # cannot collide with a conversation id (a NUL never comes from Mem0)


class RunIdFilterWarning(UserWarning):
    """Warned (once per wrapper) when ``run_id`` named the conversation and Mem0's search found nothing.

    Mem0 filters memories by ``run_id``: memories stored per user without that run id are not found. Name the
    conversation with ``conversation_id=`` (cpmemory's alone, never sent to Mem0) instead.
    """


@dataclass(frozen=True, slots=True)
class PassthroughTurn:
    """The prompt of a search made without a conversation id: nothing is reserved, nothing to commit."""

    messages: list[dict[str, str]]


class _Mem0Adapter:
    """What the sync and async wrappers share: arguments, conversation id, result assembly. No IO."""

    def __init__(
        self, memory: Any, cpmemory: Any, *, tenant: str, system_prompt: str | None, max_prompt_tokens: int | None
    ) -> None:
        self._memory = memory
        self._cpmemory = cpmemory
        self._tenant = tenant
        self._system_prompt = system_prompt
        self._max_prompt_tokens = max_prompt_tokens
        self._pending = PendingTurns(pending_limit(cpmemory))
        self._warned_run_id = False

    @property
    def pending(self) -> PendingTurns:
        """Searches not yet committed or aborted, one per conversation; bounded by the facade's
        ``max_pending_turns`` (the oldest are aborted, counted in ``pending.evicted``)."""
        return self._pending

    @property
    def memory(self) -> Any:
        """The wrapped Mem0 object."""
        return self._memory

    @property
    def cpmemory(self) -> Any:
        """The cpmemory facade deciding what is sent."""
        return self._cpmemory

    def __getattr__(self, name: str) -> Any:
        # Any Mem0 method not listed explicitly (delete_all, reset, chat, close, ...) passes through unchanged.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._memory, name)

    @staticmethod
    def _search_arguments(
        user_id: str | None,
        agent_id: str | None,
        run_id: str | None,
        filters: Mapping[str, Any] | None,
        options: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Mem0 2.x takes entity ids in ``filters`` only; accept them top level too and fold them in."""
        merged = dict(filters or {})
        for key, value in (("user_id", user_id), ("agent_id", agent_id), ("run_id", run_id)):
            if value is not None:
                merged[key] = value
        arguments = {key: value for key, value in options.items() if value is not None}
        if merged:
            arguments["filters"] = merged
        return arguments

    @staticmethod
    def _conversation(conversation_id: str | None, arguments: Mapping[str, Any]) -> str | None:
        if conversation_id is not None:
            return conversation_id
        run_id = (arguments.get("filters") or {}).get("run_id")
        return run_id if isinstance(run_id, str) and run_id else None

    def _check_found(self, conversation_id: str | None, conversation: str | None, parsed: ParsedResults) -> None:
        """Warn once when ``run_id`` named the conversation and Mem0 found nothing (it filtered by that run id)."""
        if conversation_id is not None or conversation is None or parsed.items or self._warned_run_id:
            return
        self._warned_run_id = True
        warnings.warn(
            f"CpMemoryMem0: search with run_id={conversation!r} as the conversation found no memories. Mem0 "
            "filters by run_id, so memories stored without it (per user_id) are not found; name the conversation "
            "with conversation_id= instead (cpmemory's own, never sent to Mem0). Warned once per wrapper.",
            RunIdFilterWarning,
            stacklevel=3,
        )

    def _passthrough(
        self, query: str, parsed: ParsedResults, history: Sequence[Mapping[str, str]] | None
    ) -> tuple[Any, list[Any]]:
        """The pass-through answer, and the prepared turns it displaced (to abort)."""
        warnings.warn(
            "CpMemoryMem0: search without conversation_id; blocks ordered online, nothing de-duplicated "
            "or recorded for a conversation",
            PassthroughWarning,
            stacklevel=3,
        )
        system_prompt = facade_system_prompt(self._cpmemory, self._system_prompt)
        blocks = online_order(self._cpmemory, parsed.blocks, self._tenant)
        messages = passthrough_messages(query, blocks, history=history, system_prompt=system_prompt)
        displaced = self._pending.put(_PASSTHROUGH_KEY, PassthroughTurn(messages))
        stale = [turn for turn in displaced if not isinstance(turn, PassthroughTurn)]
        return assemble_passthrough(parsed, NO_CONVERSATION_REASON), stale

    def _prepare_kwargs(
        self, history: Sequence[Mapping[str, str]] | None, max_prompt_tokens: int | None = None
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"history": history, "tenant": self._tenant, "system_prompt": self._system_prompt}
        budget = max_prompt_tokens if max_prompt_tokens is not None else self._max_prompt_tokens
        if budget is not None:
            kwargs["max_prompt_tokens"] = budget
        return kwargs

    def chat_messages(self, conversation_id: str | None = None) -> list[dict[str, str]]:
        """Return the chat messages of the conversation's pending turn (prepared by the last ``search``).

        Args:
            conversation_id: the conversation (the ``conversation_id``, or ``run_id``, used in ``search``); None for
                the last search made without one.

        Raises:
            UnknownReservationError: no search is pending for that conversation.
        """
        turn = self._pending.get(_PASSTHROUGH_KEY if conversation_id is None else conversation_id)
        if turn is None:
            raise UnknownReservationError(f"no pending Mem0 search for conversation {conversation_id!r}")
        return [dict(message) for message in turn.messages]

    build_messages = chat_messages

    def pending_turn(self, conversation_id: str) -> Any | None:
        """Return the conversation's prepared, uncommitted turn (a ``PreparedTurn``), or None."""
        turn = self._pending.get(conversation_id)
        return None if isinstance(turn, PassthroughTurn) else turn

    @staticmethod
    def _key(conversation_id: str | None) -> str:
        return _PASSTHROUGH_KEY if conversation_id is None else conversation_id

    def _to_commit(self, answer: Any, conversation_id: str | None) -> tuple[str, Any]:
        """(pending key, the pending turn: a PreparedTurn or a PassthroughTurn). Removes nothing: the turn is
        dropped only once its commit succeeded (:meth:`_finished`), so a failed commit can be retried or aborted.

        Raises:
            InvalidInputError: ``answer`` is not a string. UnknownReservationError: nothing is pending.
        """
        if not isinstance(answer, str):
            raise InvalidInputError(f"answer must be a string, got {type(answer).__name__}")
        key = self._key(conversation_id)
        turn = self._pending.get(key)
        if turn is None:
            raise UnknownReservationError(f"no pending Mem0 search for conversation {conversation_id!r}")
        return key, turn

    def _finished(self, key: str, turn: Any, error: BaseException | None = None) -> None:
        """Drop the pending turn after its commit or abort, or after a final error (the reservation is gone)."""
        if error is None or isinstance(error, ReservationError):
            self._pending.discard(key, turn)

    def _search_setup(
        self,
        user_id: str | None,
        agent_id: str | None,
        run_id: str | None,
        filters: Mapping[str, Any] | None,
        options: dict[str, Any],
        conversation_id: str | None,
    ) -> tuple[dict[str, Any], str | None]:
        """Mem0's search arguments and the conversation of the turn."""
        arguments = self._search_arguments(user_id, agent_id, run_id, filters, options)
        return arguments, self._conversation(conversation_id, arguments)


class CpMemoryMem0(_Mem0Adapter):
    """A ``mem0.Memory`` (or hosted ``MemoryClient``) whose ``search`` goes through cpmemory.

    Args:
        memory: the Mem0 object to wrap (anything with Mem0's ``search`` / ``add`` / ... methods).
        cpmemory: a ``cpmemory.CpMemory``; None builds one with the in-memory session store.
        tenant: the cpmemory tenant this wrapper's conversations belong to.
        system_prompt: an optional system prompt placed first in every turn's messages.
        max_prompt_tokens: the token budget of every prepared turn's prompt (None: the facade's
            ``CpMemoryConfig.max_prompt_tokens``); ``search(max_prompt_tokens=...)`` overrides it per call.
    """

    def __init__(
        self,
        memory: Any,
        cpmemory: Any = None,
        *,
        tenant: str = "default",
        system_prompt: str | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        if cpmemory is None:
            from cpmemory import CpMemory

            cpmemory = CpMemory()
        super().__init__(
            memory, cpmemory, tenant=tenant, system_prompt=system_prompt, max_prompt_tokens=max_prompt_tokens
        )

    def search(
        self,
        query: str,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        top_k: int | None = None,
        threshold: float | None = None,
        rerank: bool | None = None,
        conversation_id: str | None = None,
        history: Sequence[Mapping[str, str]] | None = None,
        max_prompt_tokens: int | None = None,
        **options: Any,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Search Mem0, then reorder / de-duplicate the results for this conversation's turn.

        Mutates: prepares (reserves) a turn for the conversation, replacing (aborting) an uncommitted one; past
        the facade's ``max_pending_turns`` conversations the oldest uncommitted turn is aborted too (``pending``).
        Options left None use Mem0's defaults; other keyword options go to Mem0 unchanged.

        Args:
            conversation_id: the conversation this search is a turn of (cpmemory's own; never sent to Mem0, so
                ``user_id`` memories are found in every conversation). Without it ``run_id`` names the
                conversation (Mem0 then also filters by it); with neither, the results pass through.

        Returns:
            Mem0's answer in its own shape, items in prompt order, each with a ``cpmemory`` field.

        Raises:
            InvalidInputError: the answer or one of its items is malformed (see ``mem0_cpmemory.results``).
        """
        options.update(top_k=top_k, threshold=threshold, rerank=rerank)
        arguments, conversation = self._search_setup(
            user_id, agent_id, run_id, filters, options, conversation_id
        )
        parsed = parse_search_results(self._memory.search(query, **arguments))
        self._check_found(conversation_id, conversation, parsed)
        if conversation is None:
            answer, stale = self._passthrough(query, parsed, history)
        else:
            turn = self._cpmemory.prepare(
                conversation, query, list(parsed.blocks), **self._prepare_kwargs(history, max_prompt_tokens)
            )
            answer, stale = assemble_prepared(parsed, turn), self._pending.put(conversation, turn)
        for displaced in stale:
            if not isinstance(displaced, PassthroughTurn):
                self._cpmemory.abort(displaced)
        return answer

    def commit(self, answer: str, *, conversation_id: str | None = None) -> int:
        """Record the model's answer for the conversation's pending turn; return the committed turn number.

        A pass-through turn (no conversation id) records nothing and returns 0.

        Raises:
            UnknownReservationError: nothing is pending for the conversation.
        """
        key, turn = self._to_commit(answer, conversation_id)
        if isinstance(turn, PassthroughTurn):
            self._finished(key, turn)
            return 0
        try:
            number = int(self._cpmemory.commit(turn, answer))
        except CpMemoryError as error:
            self._finished(key, turn, error)
            raise
        self._finished(key, turn)
        return number

    def abort(self, *, conversation_id: str | None = None) -> bool:
        """Drop the conversation's pending turn (nothing is recorded); False when none was pending."""
        key = self._key(conversation_id)
        turn = self._pending.get(key)
        if turn is None:
            return False
        released = True if isinstance(turn, PassthroughTurn) else bool(self._cpmemory.abort(turn))
        self._finished(key, turn)
        return released

    # Mem0 methods passed through unchanged (listed for typing and discoverability).
    def add(self, messages: Any, **kwargs: Any) -> Any:
        """``Memory.add`` unchanged."""
        return self._memory.add(messages, **kwargs)

    def get(self, memory_id: str) -> Any:
        """``Memory.get`` unchanged."""
        return self._memory.get(memory_id)

    def get_all(self, **kwargs: Any) -> Any:
        """``Memory.get_all`` unchanged."""
        return self._memory.get_all(**kwargs)

    def update(self, memory_id: str, *args: Any, **kwargs: Any) -> Any:
        """``Memory.update`` unchanged (the next search reports the memory as ``changed``)."""
        return self._memory.update(memory_id, *args, **kwargs)

    def delete(self, memory_id: str, *args: Any, **kwargs: Any) -> Any:
        """``Memory.delete`` unchanged."""
        return self._memory.delete(memory_id, *args, **kwargs)

    def delete_all(self, **kwargs: Any) -> Any:
        """``Memory.delete_all`` unchanged."""
        return self._memory.delete_all(**kwargs)

    def history(self, memory_id: str) -> Any:
        """``Memory.history`` unchanged."""
        return self._memory.history(memory_id)

    def reset(self) -> Any:
        """``Memory.reset`` unchanged (cpmemory's conversation state is kept)."""
        return self._memory.reset()


class AsyncCpMemoryMem0(_Mem0Adapter):
    """An ``mem0.AsyncMemory`` (or ``AsyncMemoryClient``) whose ``search`` goes through cpmemory (awaited).

    Args:
        memory: the async Mem0 object to wrap.
        cpmemory: a ``cpmemory.AsyncCpMemory``; None builds one with the in-memory session store.
        tenant: the cpmemory tenant this wrapper's conversations belong to.
        system_prompt: an optional system prompt placed first in every turn's messages.
        max_prompt_tokens: the token budget of every prepared turn's prompt (None: the facade's
            ``CpMemoryConfig.max_prompt_tokens``); ``search(max_prompt_tokens=...)`` overrides it per call.
    """

    def __init__(
        self,
        memory: Any,
        cpmemory: Any = None,
        *,
        tenant: str = "default",
        system_prompt: str | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        if cpmemory is None:
            from cpmemory import AsyncCpMemory

            cpmemory = AsyncCpMemory()
        super().__init__(
            memory, cpmemory, tenant=tenant, system_prompt=system_prompt, max_prompt_tokens=max_prompt_tokens
        )

    async def search(
        self,
        query: str,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        top_k: int | None = None,
        threshold: float | None = None,
        rerank: bool | None = None,
        conversation_id: str | None = None,
        history: Sequence[Mapping[str, str]] | None = None,
        max_prompt_tokens: int | None = None,
        **options: Any,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Async :meth:`CpMemoryMem0.search` (same arguments, result and errors)."""
        options.update(top_k=top_k, threshold=threshold, rerank=rerank)
        arguments, conversation = self._search_setup(
            user_id, agent_id, run_id, filters, options, conversation_id
        )
        parsed = parse_search_results(await self._memory.search(query, **arguments))
        self._check_found(conversation_id, conversation, parsed)
        if conversation is None:
            answer, stale = self._passthrough(query, parsed, history)
        else:
            blocks: list[Block] = list(parsed.blocks)
            turn = await self._cpmemory.prepare(
                conversation, query, blocks, **self._prepare_kwargs(history, max_prompt_tokens)
            )
            answer, stale = assemble_prepared(parsed, turn), self._pending.put(conversation, turn)
        for displaced in stale:
            if not isinstance(displaced, PassthroughTurn):
                await self._cpmemory.abort(displaced)
        return answer

    async def commit(self, answer: str, *, conversation_id: str | None = None) -> int:
        """Async :meth:`CpMemoryMem0.commit`."""
        key, turn = self._to_commit(answer, conversation_id)
        if isinstance(turn, PassthroughTurn):
            self._finished(key, turn)
            return 0
        try:
            number = int(await self._cpmemory.commit(turn, answer))
        except CpMemoryError as error:
            self._finished(key, turn, error)
            raise
        self._finished(key, turn)
        return number

    async def abort(self, *, conversation_id: str | None = None) -> bool:
        """Async :meth:`CpMemoryMem0.abort`."""
        key = self._key(conversation_id)
        turn = self._pending.get(key)
        if turn is None:
            return False
        released = True if isinstance(turn, PassthroughTurn) else bool(await self._cpmemory.abort(turn))
        self._finished(key, turn)
        return released

    async def add(self, messages: Any, **kwargs: Any) -> Any:
        """``AsyncMemory.add`` unchanged."""
        return await self._memory.add(messages, **kwargs)

    async def get(self, memory_id: str) -> Any:
        """``AsyncMemory.get`` unchanged."""
        return await self._memory.get(memory_id)

    async def get_all(self, **kwargs: Any) -> Any:
        """``AsyncMemory.get_all`` unchanged."""
        return await self._memory.get_all(**kwargs)

    async def update(self, memory_id: str, *args: Any, **kwargs: Any) -> Any:
        """``AsyncMemory.update`` unchanged."""
        return await self._memory.update(memory_id, *args, **kwargs)

    async def delete(self, memory_id: str, *args: Any, **kwargs: Any) -> Any:
        """``AsyncMemory.delete`` unchanged."""
        return await self._memory.delete(memory_id, *args, **kwargs)

    async def delete_all(self, **kwargs: Any) -> Any:
        """``AsyncMemory.delete_all`` unchanged."""
        return await self._memory.delete_all(**kwargs)

    async def history(self, memory_id: str) -> Any:
        """``AsyncMemory.history`` unchanged."""
        return await self._memory.history(memory_id)

    async def reset(self) -> Any:
        """``AsyncMemory.reset`` unchanged."""
        return await self._memory.reset()
