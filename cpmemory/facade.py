"""The public API: ``CpMemory`` (sync) and ``AsyncCpMemory`` (asyncio).

Both classes only do IO (the session store); every decision is made by the pure functions of
``cpmemory.session.turns`` and the per-tenant indexes of ``cpmemory.session.index``.

Online mode::

    mem = CpMemory()
    turn = mem.prepare("conversation-1", "Who wrote it?", [{"id": "doc-7", "text": "..."}])
    answer = my_llm(turn.messages)
    mem.commit(turn, answer)            # or mem.abort(turn) when the LLM call failed

Offline mode: ``mem.plan_batch(list_of_block_lists)`` returns the execution order and each request's block ids in
the reordered order (pass them back as ``prompt_order=`` to ``prepare``).

Store failures (StoreUnavailableError, connection or timeout errors, any redis error) make ``prepare`` a degraded
pass-through: relevance order, every block in full, nothing reserved; it is logged once per outage and counted. The
turn still gets its conversation's history and next turn number from a bounded local copy of recent transcripts,
and its commit (or any commit the store could not take) is kept and written back at the conversation's next turn
that reaches the store (``cpmemory.session.recent``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cpmemory.core.blocks import BlockLike, normalize_blocks
from cpmemory.errors import (
    PromptBudgetError,
    ReservationExpiredError,
    TokenCounterError,
    UnknownReservationError,
)
from cpmemory.session.config import CpMemoryConfig
from cpmemory.session.lifecycle import FacadeCore, IndexEvictor, is_store_failure, shared_evictions
from cpmemory.session.turns import PreparedTurn, reserve_request
from cpmemory.stores.base import AsyncSessionStore, SessionStore
from cpmemory.stores.memory import AsyncInMemorySessionStore, InMemorySessionStore
from cpmemory.types import BatchPlan, ConversationKey, ConversationState, Reservation, TurnRecord

logger = logging.getLogger(__name__)

__all__ = ["AsyncCpMemory", "CpMemory", "IndexEvictor", "is_store_failure"]



class CpMemory(FacadeCore):
    """Context reuse for one process (sync). Thread-safe.

    Args:
        store: a SessionStore; defaults to a new InMemorySessionStore.
        config: tunables (CpMemoryConfig).
    """

    def __init__(self, store: SessionStore | None = None, config: CpMemoryConfig | None = None) -> None:
        super().__init__(config)
        self.store: SessionStore = (
            store if store is not None else InMemorySessionStore(ttl_s=self.config.ttl_s)
        )

    def prepare(
        self,
        conversation_id: str,
        query: str,
        blocks: Iterable[BlockLike],
        *,
        history: Iterable[Mapping[str, Any]] | None = None,
        tenant: str = "default",
        system_prompt: str | None = None,
        prompt_order: Iterable[Any] | None = None,
        max_prompt_tokens: int | None = None,
    ) -> PreparedTurn:
        """Prepare one turn: reserve, de-duplicate, reorder, annotate. One store round trip.

        Args:
            conversation_id: the conversation (any non-empty string up to 1,024 characters).
            query: the user's question.
            blocks: context blocks, best-ranked first (Block, {"id", "text"} or (id, text)); a repeated id keeps
                its first occurrence.
            history: messages to send before this turn; None uses the stored transcript. A history that is the
                committed conversation (each user message as sent or as its plain question, the answers, in order)
                is planned from the turns as they were sent, so the prefix and references match a call without
                history (``cpmemory.session.reconcile``; ``turn.history`` says which). References are made only
                to text present in the history sent.
            tenant: the tenant (isolates state and index).
            system_prompt: overrides the configured system prompt.
            prompt_order: block ids fixing the order of the blocks shown in full (from plan_batch).
            max_prompt_tokens: the token budget of this prompt (overrides ``CpMemoryConfig.max_prompt_tokens``).

        Returns:
            The PreparedTurn (its ``messages`` go to the LLM; with a budget, ``prompt_tokens`` <= the budget under
            the configured counter). Raises InvalidInputError subclasses on bad input (PromptBudgetError when the turn
            cannot fit, TokenCounterError when the counter fails), before anything is reserved.
        """
        budget = self._budget(max_prompt_tokens)
        turn_input = self._checked_input(
            budget,
            conversation_id,
            query,
            blocks,
            history=history,
            tenant=tenant,
            system_prompt=system_prompt,
            prompt_order=prompt_order,
        )
        try:
            self._write_back(turn_input.key)
            reservation = self.store.reserve(turn_input.key, reserve_request(turn_input, self.config))
        except Exception as error:
            if not is_store_failure(error):
                raise
            return self._degraded(turn_input, error, budget)
        try:
            return self._planned(turn_input, reservation, budget)
        except (PromptBudgetError, TokenCounterError):
            self._release(turn_input.key, reservation.reservation_id)
            raise

    def _release(self, key: ConversationKey, reservation_id: str) -> None:
        """Abort a reservation whose turn could not be planned (a store failure is left to its timeout)."""
        try:
            self.store.abort(key, reservation_id)
        except Exception as error:
            if not is_store_failure(error):
                raise

    def _write_back(self, key: ConversationKey) -> None:
        """Write the commits kept during an outage to the store, in order (``cpmemory.session.recent``); a store
        failure is raised (the rest wait again)."""
        if not self._recent.pending(key):
            return
        opened: Reservation | None = self.store.reserve(key, self._late_request())
        assert opened is not None
        back = self._recent.take(key, opened.turn)
        done = 0
        try:
            for _, record in back.rewrite:
                opened = self._write_one(key, opened, "", record)
            for kept in back.kept:
                opened = self._write_one(key, opened, kept.reservation_id, kept.record)
                done += 1
        except BaseException:
            self._recent.give_back(key, back.kept[done:])
            raise
        finally:
            if opened is not None:
                self._release(key, opened.reservation_id)
        self._wrote_back(key, done)

    def _write_one(
        self, key: ConversationKey, opened: Reservation | None, reservation_id: str, record: TurnRecord
    ) -> Reservation | None:
        """Commit one kept record (under ``reservation_id`` first: one that had landed is not repeated; else under
        ``opened`` or a new reservation); returns the reservation still open. A store failure is raised; any other
        error drops the record (logged, counted)."""
        try:
            if reservation_id:
                try:
                    self.store.commit(key, reservation_id, record)
                    return opened
                except (ReservationExpiredError, UnknownReservationError):
                    pass
            opened = opened or self.store.reserve(key, self._late_request())
            self.store.commit(key, opened.reservation_id, record)
            return None
        except Exception as error:
            if is_store_failure(error):
                raise
            self._write_back_failed(error)
            return opened

    def commit(self, turn_or_reservation_id: PreparedTurn | str, answer: str, *, late: bool = False) -> int:
        """Make the turn durable with the model's answer; returns the committed turn number.

        A degraded turn, or a commit the store fails on, is kept in the facade's local copy and written back at the
        conversation's next turn that reaches the store (counted: ``local_commits``, ``commit_failures``); the
        number returned is then the local copy's (0 when the conversation's earlier turns are unknown here).

        Args:
            late: a reservation that timed out is committed all the same, through a new reservation (the turn is
                appended after whatever committed meanwhile). For a caller that always ends its turns (the proxy):
                an answer that came slowly still joins the history. Off: ReservationExpiredError, nothing recorded.

        Raises:
            UnknownReservationError, ReservationExpiredError: see the store contract.
        """
        turn, record = self._to_commit(turn_or_reservation_id, answer)
        if turn.degraded:
            return self._keep(turn, record)
        try:
            try:
                number = self.store.commit(turn.key, turn.reservation_id, record)
            except ReservationExpiredError:
                if not late:
                    raise
                again = self.store.reserve(turn.key, self._late_request())
                number = self.store.commit(turn.key, again.reservation_id, record)
                self._committed_late(turn)
        except Exception as error:  # noqa: BLE001 - _commit_failed re-raises all but a store failure
            return self._commit_failed(turn, record, error)
        return self._committed(turn, number, record)

    def abort(self, turn_or_reservation_id: PreparedTurn | str) -> bool:
        """Release the turn (its LLM call failed); False when already released, unknown or degraded."""
        turn, pending = self._to_abort(turn_or_reservation_id)
        if turn is None:
            return False
        try:
            released = self.store.abort(turn.key, turn.reservation_id)
        except Exception as error:
            if not is_store_failure(error):
                raise
            released = False  # the reservation times out by itself
            self._after_abort(turn, released, pending)
            return released
        self._after_abort(turn, released, False)
        return released

    def plan_batch(self, requests: Sequence[Iterable[BlockLike]], *, tenant: str = "default") -> BatchPlan:
        """Reorder and schedule a batch of requests and insert them in the tenant's index (mutates the index).

        Args:
            requests: each request's blocks, best-ranked first.
            tenant: the tenant whose index receives the requests.

        Returns:
            The execution order, each request's reordered block ids and index request ids.
        """
        return self._plan_batch(requests, tenant)

    def evict(self, request_ids: Iterable[str], *, tenant: str = "default") -> int:
        """Remove the leaves of ``request_ids`` from the tenant's index (engine eviction sync). Returns how many.

        With a Redis store the tenant's shared decision state forgets them too (a store failure is logged: the
        shared state then keeps their weight until they age out).
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif isinstance(request_ids, Iterable) and not isinstance(request_ids, (bytes, Mapping)):
            request_ids = list(request_ids)
        removed = self._evict(request_ids, tenant)  # validates request_ids
        shared = shared_evictions(self.store)
        if shared is not None and request_ids:
            shared(tenant, list(request_ids))
        return removed

    def order_blocks(self, blocks: Iterable[BlockLike], *, tenant: str = "default") -> list[Any]:
        """See :meth:`FacadeCore.order_blocks`; with a Redis store the tenant's shared decision state decides
        (one round trip; a store failure falls back to this process's orderer)."""
        shared = getattr(self.store, "decide_order", None)
        if shared is None:
            return super().order_blocks(blocks, tenant=tenant)
        ConversationKey(tenant, "stateless")
        normalized = normalize_blocks(blocks)
        by_hash: dict[str, list[Any]] = {}
        for block in normalized:
            by_hash.setdefault(block.content_hash, []).append(block)
        sizes = [float(len(group[0].text) + 1) for group in by_hash.values()]
        try:
            order = shared(tenant, list(by_hash), sizes, uuid.uuid4().hex)
        except Exception as error:
            if not is_store_failure(error):
                raise
            return super().order_blocks(normalized, tenant=tenant)
        placed = [key for key in dict.fromkeys(order) if key in by_hash]
        placed += [key for key in by_hash if key not in set(placed)]
        return [block for key in placed for block in by_hash[key]]

    def reset_index(self, tenant: str | None = None) -> None:
        """Drop one tenant's index (or all of them): the engine's cache was flushed. With a Redis store the shared
        decision state stops trusting the orders recorded before (at the next decision call of each tenant)."""
        self._reset_index(tenant)

    def state(self, conversation_id: str, *, tenant: str = "default") -> ConversationState:
        """Return the stored state of one conversation (for inspection and tools; not on the hot path)."""
        return self.store.load(ConversationKey(tenant, conversation_id))

    def forget(self, conversation_id: str, *, tenant: str = "default") -> None:
        """Delete one conversation's stored state (its open turns become unknown)."""
        key = ConversationKey(tenant, conversation_id)
        self.store.delete(key)
        self._segments.forget(key)
        self._recent.forget(key)


class AsyncCpMemory(FacadeCore):
    """Context reuse for asyncio applications: the same API as CpMemory, awaited.

    Args:
        store: an AsyncSessionStore; defaults to a new AsyncInMemorySessionStore.
        config: tunables (CpMemoryConfig).
    """

    def __init__(self, store: AsyncSessionStore | None = None, config: CpMemoryConfig | None = None) -> None:
        super().__init__(config)
        self.store: AsyncSessionStore = (
            store if store is not None else AsyncInMemorySessionStore(ttl_s=self.config.ttl_s)
        )

    async def prepare(
        self,
        conversation_id: str,
        query: str,
        blocks: Iterable[BlockLike],
        *,
        history: Iterable[Mapping[str, Any]] | None = None,
        tenant: str = "default",
        system_prompt: str | None = None,
        prompt_order: Iterable[Any] | None = None,
        max_prompt_tokens: int | None = None,
    ) -> PreparedTurn:
        """See :meth:`CpMemory.prepare`."""
        budget = self._budget(max_prompt_tokens)
        turn_input = self._checked_input(
            budget,
            conversation_id,
            query,
            blocks,
            history=history,
            tenant=tenant,
            system_prompt=system_prompt,
            prompt_order=prompt_order,
        )
        try:
            await self._write_back(turn_input.key)
            reservation = await self.store.reserve(turn_input.key, reserve_request(turn_input, self.config))
        except Exception as error:
            if not is_store_failure(error):
                raise
            return self._degraded(turn_input, error, budget)
        try:
            return self._planned(turn_input, reservation, budget)
        except (PromptBudgetError, TokenCounterError):
            await self._release(turn_input.key, reservation.reservation_id)
            raise

    async def _release(self, key: ConversationKey, reservation_id: str) -> None:
        """See :meth:`CpMemory._release`."""
        try:
            await self.store.abort(key, reservation_id)
        except Exception as error:
            if not is_store_failure(error):
                raise

    async def _write_back(self, key: ConversationKey) -> None:
        """See :meth:`CpMemory._write_back`."""
        if not self._recent.pending(key):
            return
        opened: Reservation | None = await self.store.reserve(key, self._late_request())
        assert opened is not None
        back = self._recent.take(key, opened.turn)
        done = 0
        try:
            for _, record in back.rewrite:
                opened = await self._write_one(key, opened, "", record)
            for kept in back.kept:
                opened = await self._write_one(key, opened, kept.reservation_id, kept.record)
                done += 1
        except BaseException:
            self._recent.give_back(key, back.kept[done:])
            raise
        finally:
            if opened is not None:
                await self._release(key, opened.reservation_id)
        self._wrote_back(key, done)

    async def _write_one(
        self, key: ConversationKey, opened: Reservation | None, reservation_id: str, record: TurnRecord
    ) -> Reservation | None:
        """See :meth:`CpMemory._write_one`."""
        try:
            if reservation_id:
                try:
                    await self.store.commit(key, reservation_id, record)
                    return opened
                except (ReservationExpiredError, UnknownReservationError):
                    pass
            opened = opened or await self.store.reserve(key, self._late_request())
            await self.store.commit(key, opened.reservation_id, record)
            return None
        except Exception as error:
            if is_store_failure(error):
                raise
            self._write_back_failed(error)
            return opened

    async def commit(self, turn_or_reservation_id: PreparedTurn | str, answer: str, *, late: bool = False) -> int:
        """See :meth:`CpMemory.commit`."""
        turn, record = self._to_commit(turn_or_reservation_id, answer)
        if turn.degraded:
            return self._keep(turn, record)
        try:
            try:
                number = await self.store.commit(turn.key, turn.reservation_id, record)
            except ReservationExpiredError:
                if not late:
                    raise
                again = await self.store.reserve(turn.key, self._late_request())
                number = await self.store.commit(turn.key, again.reservation_id, record)
                self._committed_late(turn)
        except Exception as error:  # noqa: BLE001 - _commit_failed re-raises all but a store failure
            return self._commit_failed(turn, record, error)
        return self._committed(turn, number, record)

    async def abort(self, turn_or_reservation_id: PreparedTurn | str) -> bool:
        """See :meth:`CpMemory.abort`."""
        turn, pending = self._to_abort(turn_or_reservation_id)
        if turn is None:
            return False
        try:
            released = await self.store.abort(turn.key, turn.reservation_id)
        except Exception as error:
            if not is_store_failure(error):
                raise
            released = False
            self._after_abort(turn, released, pending)
            return released
        self._after_abort(turn, released, False)
        return released

    async def plan_batch(self, requests: Sequence[Iterable[BlockLike]], *, tenant: str = "default") -> BatchPlan:
        """See :meth:`CpMemory.plan_batch` (CPU-bound: runs in the event loop's thread)."""
        return self._plan_batch(requests, tenant)

    async def evict(self, request_ids: Iterable[str], *, tenant: str = "default") -> int:
        """See :meth:`CpMemory.evict` (with a Redis store, the shared decision state forgets them too)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif isinstance(request_ids, Iterable) and not isinstance(request_ids, (bytes, Mapping)):
            request_ids = list(request_ids)
        removed = self._evict(request_ids, tenant)  # validates request_ids
        shared = getattr(self.store, "evict_decisions", None)
        if shared is not None and request_ids:
            try:
                await shared(tenant, list(request_ids))  # type: ignore[arg-type]
            except Exception as error:
                if not is_store_failure(error):
                    raise
                logger.warning("shared decision state not updated for %d evictions: %s", len(request_ids), error)
        return removed

    async def reset_index(self, tenant: str | None = None) -> None:
        """See :meth:`CpMemory.reset_index`."""
        self._reset_index(tenant)

    async def state(self, conversation_id: str, *, tenant: str = "default") -> ConversationState:
        """See :meth:`CpMemory.state`."""
        return await self.store.load(ConversationKey(tenant, conversation_id))

    async def forget(self, conversation_id: str, *, tenant: str = "default") -> None:
        """See :meth:`CpMemory.forget`."""
        key = ConversationKey(tenant, conversation_id)
        await self.store.delete(key)
        self._segments.forget(key)
        self._recent.forget(key)
