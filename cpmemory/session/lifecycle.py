"""State and logic shared by the sync and async facades (``cpmemory.facade``): no store IO here.

:class:`FacadeCore` holds a facade's config, counters, per-tenant indexes, segment cache and pending turns, and
turns the pure steps of :mod:`cpmemory.session.turns` into the facade's prepare / commit / abort bookkeeping; the
facades add the store calls. :class:`IndexEvictor` is the synchronous index maintenance the KV-event thread drives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from cpmemory.core.blocks import BlockLike, normalize_blocks
from cpmemory.core.scheduling import ReleasePlan
from cpmemory.errors import (
    InvalidInputError,
    PromptBudgetError,
    StoreUnavailableError,
    TokenCounterError,
    UnknownReservationError,
)
from cpmemory.session.batch import plan_contexts
from cpmemory.session.budget import PromptBudget, check_budget, estimate_tokens
from cpmemory.session.budgeted import check_turn_alone, fit_degraded, plan_budgeted
from cpmemory.session.config import CpMemoryConfig
from cpmemory.session.counters import FacadeCounters
from cpmemory.session.index import Placement, TenantIndexes
from cpmemory.session.recent import Kept, RecentTranscripts
from cpmemory.session.reconcile import Outcome, dropped, offered_history, reconcile
from cpmemory.session.segments import SegmentCache
from cpmemory.session.turn_input import TurnInput, make_input
from cpmemory.session.turns import (
    PreparedTurn,
    commit_record,
    degraded_turn,
    plan_turn,
    turn_counts,
)
from cpmemory.types import BatchPlan, ConversationKey, Message, ReserveRequest, TurnRecord

logger = logging.getLogger(__name__)


def is_store_failure(error: BaseException) -> bool:
    """True for errors that mean "the store cannot be reached": ours, OS-level, or any redis-py error."""
    if isinstance(error, (StoreUnavailableError, ConnectionError, TimeoutError, OSError)):
        return True
    return any(cls.__module__.split(".")[0] == "redis" for cls in type(error).__mro__)


class FacadeCore:
    """State and logic shared by the sync and async facades (no store IO here)."""

    def __init__(self, config: CpMemoryConfig | None) -> None:
        if config is not None and not isinstance(config, CpMemoryConfig):
            raise InvalidInputError("config must be a CpMemoryConfig")
        self.config = config or CpMemoryConfig()
        self.counters = FacadeCounters()
        self._indexes = TenantIndexes(self.config.alpha, self.config.max_leaves_per_tenant)
        self._pending: OrderedDict[str, tuple[float, PreparedTurn]] = OrderedDict()
        self._pending_lock = threading.Lock()
        self._outage = False
        self._segments = SegmentCache()
        self._token_counts: dict[str, int] = {}  # shared by every call's PromptBudget (bounded there)
        # recent transcripts: an outage never makes the model forget (cpmemory.session.recent)
        self._recent = RecentTranscripts(on_lost=lambda count: self.counters.add(local_commits_lost=count))

    # -- prepare -------------------------------------------------------------------------------------------------
    def _input(
        self, conversation_id: str, query: str, blocks: Iterable[BlockLike], **kwargs: Any
    ) -> TurnInput:
        return make_input(conversation_id, query, blocks, config=self.config, **kwargs)

    def _budget(self, override: int | None) -> PromptBudget | None:
        """The token budget of one call (``max_prompt_tokens`` argument, else the config's); None when none."""
        limit = override if override is not None else self.config.max_prompt_tokens
        if limit is None:
            return None
        counter = self.config.token_counter or estimate_tokens
        return PromptBudget(check_budget(limit), counter, self.config.message_overhead_tokens, self._token_counts)

    def _checked_input(self, budget: PromptBudget | None, *args: Any, **kwargs: Any) -> TurnInput:
        """Validate the call; with a budget, check that the turn fits alone (all before anything is reserved)."""
        turn_input = self._input(*args, **kwargs)
        if budget is not None:
            check_turn_alone(turn_input, self.config, budget)
        return turn_input

    def _planned(self, turn_input: TurnInput, reservation: Any, budget: PromptBudget | None = None) -> PreparedTurn:
        if self._outage:
            self._outage = False
            logger.warning("session store reachable again; de-duplication resumed")
        self._recent.seen(turn_input.key, reservation)
        transcript = reservation.transcript
        outcome, planned = reconcile(turn_input, transcript, reservation.transcript_start, reservation.turn)
        # A conversation's history only grows: its segment index is cached and extended (stored or given history).
        source = self._segments.source(turn_input.key)
        try:
            if budget is not None:
                turn = plan_budgeted(planned, reservation, self._indexes, self.config, budget, source)
            else:
                turn = plan_turn(planned, reservation, self._indexes, self.config, source)
        except (PromptBudgetError, TokenCounterError):
            raise
        except Exception:  # an index bug must not lose the request: fall back to relevance order
            logger.exception("context index failed; tenant index reset, request kept in relevance order")
            self.counters.add(index_errors=1)
            self._indexes.reset(turn_input.key.tenant)
            if budget is not None:
                turn = plan_budgeted(planned, reservation, _NoIndex(), self.config, budget)
            else:
                turn = plan_turn(planned, reservation, _NoIndex(), self.config)
        turn = self._reported(turn_input, turn, outcome, transcript)
        self._remember(turn)
        self.counters.add(**turn_counts(turn, self.config.chars_per_token))
        return turn

    def _reported(
        self, turn_input: TurnInput, turn: PreparedTurn, outcome: Outcome, transcript: Sequence[Message] | None
    ) -> PreparedTurn:
        """The turn with how its history was used and what of it was left out (counted)."""
        messages, turns = dropped(offered_history(turn_input, transcript), turn.history_sent, outcome == "matched")
        self.counters.add(**{f"histories_{outcome}": 1}, history_messages_dropped=messages,
                          history_turns_dropped=turns)
        return dataclasses.replace(turn, history=outcome, history_dropped=(messages, turns))

    def _degraded(
        self, turn_input: TurnInput, error: BaseException, budget: PromptBudget | None = None
    ) -> PreparedTurn:
        if not self._outage:
            self._outage = True
            logger.warning("session store unavailable (%s); serving pass-through until it returns", error)
        local = self._recent.history(turn_input.key, self.config.max_history_turns)
        known = local.messages if local.known else None
        outcome, planned = reconcile(turn_input, known, local.start, local.turns)
        use_local = planned.given_history is None  # what is held (an unknown conversation: its outage turns)
        turn = degraded_turn(planned, self.config, local.messages if use_local else None,
                             local.turns + 1 if local.known else 0)
        if budget is not None:
            turn = fit_degraded(turn, budget)
        turn = self._reported(turn_input, turn, outcome, known)
        self.counters.add(fallbacks=1, **turn_counts(turn, self.config.chars_per_token))
        return turn

    def _keep(self, turn: PreparedTurn, record: TurnRecord) -> int:
        """Keep a commit the store could not take, to write it back at the conversation's next turn that reaches
        the store (``cpmemory.session.recent``); returns its turn number here (0: unknown)."""
        number = self._recent.keep(turn.key, Kept("" if turn.degraded else turn.reservation_id, record))
        self._forget(turn)
        self.counters.add(local_commits=1)
        return number

    # -- pending turns (commit/abort by reservation id) -----------------------------------------------------------
    def _remember(self, turn: PreparedTurn) -> None:
        now = time.monotonic()
        horizon = now - 2 * self.config.reservation_timeout_s  # past the store's deadline: it says "expired"
        with self._pending_lock:
            self._pending[turn.reservation_id] = (
                now,
                dataclasses.replace(turn, messages=[]),
            )  # commit needs no history
            while self._pending and (
                len(self._pending) > self.config.max_pending_turns
                or next(iter(self._pending.values()))[0] < horizon
            ):
                self._pending.popitem(last=False)

    def _resolve(self, turn_or_id: PreparedTurn | str) -> PreparedTurn:
        if isinstance(turn_or_id, PreparedTurn):
            return turn_or_id
        if not isinstance(turn_or_id, str):
            raise InvalidInputError("expected a PreparedTurn or a reservation id string")
        with self._pending_lock:
            entry = self._pending.get(turn_or_id)
        if entry is None:
            raise UnknownReservationError(f"unknown reservation {turn_or_id!r}")
        return entry[1]

    def _to_commit(self, turn_or_id: PreparedTurn | str, answer: str) -> tuple[PreparedTurn, TurnRecord]:
        """Resolve the turn and build its record (validates ``answer`` before any store call)."""
        turn = self._resolve(turn_or_id)
        return turn, commit_record(turn, answer)

    def _commit_failed(self, turn: PreparedTurn, record: TurnRecord, error: Exception) -> int:
        """A commit the store raised on: a store failure is counted and the turn kept to be written back
        (:meth:`_keep`, its number returned); anything else is re-raised."""
        if not is_store_failure(error):
            raise error
        self.counters.add(commit_failures=1)
        logger.warning("commit of %s failed (%s); kept to be written back", turn.request_id or turn.reservation_id,
                       error)
        return self._keep(turn, record)

    def _to_abort(self, turn_or_id: PreparedTurn | str) -> tuple[PreparedTurn | None, bool]:
        """(the turn to release, or None when it is unknown or degraded; whether this facade still holds it open)."""
        try:
            turn = self._resolve(turn_or_id)
        except UnknownReservationError:
            return None, False
        with self._pending_lock:
            pending = turn.reservation_id in self._pending
        return (None if turn.degraded else turn), pending

    def _late_request(self) -> ReserveRequest:
        """The reservation a late commit goes through: it reads nothing (the record was planned at prepare)."""
        return ReserveRequest(blocks=(), reservation_timeout_s=self.config.reservation_timeout_s,
                              include_transcript=False)

    def _wrote_back(self, key: ConversationKey, count: int) -> None:
        self._recent.written(key)
        self.counters.add(local_writebacks=count)
        logger.info("%d turns kept during a store outage written back", count)

    def _write_back_failed(self, error: Exception) -> None:
        logger.error("a turn kept during a store outage could not be written back and is dropped: %r", error)
        self.counters.add(local_commits_lost=1)

    def _committed_late(self, turn: PreparedTurn) -> None:
        logger.info("turn %s committed late (its reservation had timed out)", turn.request_id or turn.reservation_id)
        self.counters.add(late_commits=1)

    def _committed(self, turn: PreparedTurn, number: int, record: TurnRecord) -> int:
        self._recent.committed(turn.key, number, record)
        self._forget(turn)
        self.counters.add(commits=1)
        return number

    def _forget(self, turn: PreparedTurn) -> None:
        with self._pending_lock:
            self._pending.pop(turn.reservation_id, None)

    def _after_abort(self, turn: PreparedTurn, released: bool, unsure_open: bool) -> None:
        """Forget the turn; evict its index leaf only when the abort released it, or the store could not say and
        the turn was still open here (``unsure_open``): a late abort, after commit, never touches the index."""
        self._forget(turn)
        if turn.request_id and (released or unsure_open):
            # the engine never finished this request: its prefix is not cached for us
            removed = self._indexes.evict(turn.tenant, [turn.request_id])
            self.counters.add(index_evictions=removed)
        self.counters.add(aborts=int(released))

    # -- offline mode and index maintenance -----------------------------------------------------------------------
    def _plan_batch(self, requests: Sequence[Iterable[BlockLike]], tenant: str) -> BatchPlan:
        if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Iterable):
            raise InvalidInputError("requests must be a list of block lists")
        ConversationKey(tenant, "batch")  # validates the tenant id (InvalidIdentifierError)
        block_lists = [normalize_blocks(blocks) for blocks in requests]
        order, id_lists = plan_contexts(block_lists)
        request_ids: list[str] = []
        for blocks, ids in zip(block_lists, id_lists):
            request_ids.append(self._insert_planned(tenant, blocks, ids))
        return BatchPlan(order=order, contexts=id_lists, request_ids=request_ids)

    def order_blocks(self, blocks: Iterable[BlockLike], *, tenant: str = "default") -> list[Any]:
        """The online order of a request outside any conversation (no conversation id): its blocks, prompt order.

        The tenant's online orderer decides, exactly as ``prepare`` would without ``prompt_order``; nothing is
        de-duplicated and no conversation state is read or written (no store call). The order is recorded in the
        tenant's index (the engine will cache it, so later requests can share it). Returns the normalised blocks
        (repeated ids dropped) in prompt order.
        """
        ConversationKey(tenant, "stateless")  # validates the tenant id (InvalidIdentifierError)
        normalized = normalize_blocks(blocks)
        by_hash: dict[Hashable, list[Any]] = {}
        for block in normalized:
            by_hash.setdefault(block.content_hash, []).append(block)
        context = list(by_hash)
        sizes = [float(len(by_hash[key][0].text) + 1) for key in context]
        placement = self._indexes.order_and_place(tenant, context, sizes, uuid.uuid4().hex)
        return [block for key in placement.prefix for block in by_hash[key]]

    def release_order(
        self, requests: Sequence[Iterable[BlockLike]], *, tenant: str = "default", cache_tokens: int | None = None
    ) -> list[int]:
        """The order in which to run waiting requests (the proxy's hold-and-release queue).

        The tenant's online planner orders the window (``cpmemory.core.online.OnlineOrderer.plan_window``): the
        block orders it decides are used when the requests are then prepared (without ``prompt_order``) in this
        order. A window that fits the engine's cache keeps the arrival order, each request ordered as at W=1
        (running the best-cached first gained nothing); a window whose blocks outgrow
        ``cache_tokens`` gets either those orders or a batch plan (block orders and a depth-first schedule),
        whichever finds more cached in a model of the engine's LRU cache.
        Nothing is recorded in the index until they are prepared; their blocks count as retrieved.

        Args:
            requests: the waiting requests' blocks, in arrival order.
            tenant: the tenant whose index decides.
            cache_tokens: the engine's prefix (KV) cache in tokens, when known (the blocks are measured in
                characters, ``config.chars_per_token`` to a token); None: the window is always ordered as it came.

        Returns:
            A permutation of ``range(len(requests))``.

        Raises:
            InvalidInputError: ``requests`` is not a list of block lists, or ``cache_tokens`` is negative.
        """
        contexts, sizes, capacity = self._window(requests, tenant, cache_tokens)
        return self._indexes.release_order(tenant, contexts, sizes, capacity)

    def release_plan(
        self, requests: Sequence[Iterable[BlockLike]], *, tenant: str = "default", cache_tokens: int | None = None,
        lanes: int = 1,
    ) -> ReleasePlan:
        """:meth:`release_order` for a window spread over ``lanes`` engine replicas (the proxy's hold queue).

        A window that outgrows ``cache_tokens`` (what the replicas' caches hold together) is planned as
        :meth:`release_order` plans it, then cut into one contiguous run per replica with even prefill work and
        each run put in shortest-mean-work order (``cpmemory.core.scheduling.split_lanes``); the plan's order deals
        the runs out one request from each in turn, and its ``lanes`` say which run each request belongs to. A
        window that fits gets :meth:`release_order`'s order and no lanes.

        Raises:
            InvalidInputError: as :meth:`release_order`, or ``lanes`` is not a positive integer.
        """
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise InvalidInputError(f"lanes must be a positive integer, got {lanes!r}")
        contexts, sizes, capacity = self._window(requests, tenant, cache_tokens)
        return self._indexes.release_plan(tenant, contexts, sizes, capacity, lanes)

    def _window(
        self, requests: Sequence[Iterable[BlockLike]], tenant: str, cache_tokens: int | None
    ) -> tuple[list[list[str]], list[list[float]], float | None]:
        """A window's block keys and sizes (characters), and the cache in characters; validates."""
        if isinstance(requests, (str, bytes, Mapping)):
            raise InvalidInputError("requests must be a list of block lists")
        if cache_tokens is not None and (isinstance(cache_tokens, bool) or cache_tokens < 0):
            raise InvalidInputError(f"cache_tokens must be a non-negative number of tokens, got {cache_tokens!r}")
        ConversationKey(tenant, "batch")
        contexts, sizes = [], []
        for blocks in requests:
            length: dict[str, float] = {}
            for block in normalize_blocks(blocks):
                length.setdefault(block.content_hash, float(len(block.text) + 1))
            contexts.append(list(length))
            sizes.append(list(length.values()))
        capacity = None if cache_tokens is None else cache_tokens * self.config.chars_per_token
        return contexts, sizes, capacity

    def _insert_planned(self, tenant: str, blocks: Sequence[Any], ids: Sequence[str]) -> str:
        if not ids:
            return ""
        digest_of = {block.id: block.content_hash for block in blocks}
        request_id = uuid.uuid4().hex
        placement = self._indexes.place(tenant, list(dict.fromkeys(digest_of[i] for i in ids)), request_id)
        self.counters.add(index_evictions=len(placement.evicted))
        return request_id

    def _evict(self, request_ids: Iterable[str], tenant: str) -> int:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        if isinstance(request_ids, (bytes, Mapping)) or not isinstance(request_ids, Iterable):
            raise InvalidInputError("request_ids must be a list of request id strings")
        request_ids = list(request_ids)
        if not all(isinstance(request_id, str) for request_id in request_ids):
            raise InvalidInputError("request_ids must be strings")
        removed = self._indexes.evict(_tenant(tenant), request_ids)
        self.counters.add(index_evictions=removed)
        return removed

    def _reset_index(self, tenant: str | None) -> None:
        tenant = None if tenant is None else _tenant(tenant)
        self._indexes.reset(tenant)
        # A shared decision state (Redis) stops trusting what it recorded: the engine's cache was cleared (no IO).
        distrust = getattr(getattr(self, "store", None), "distrust_decisions", None)
        if distrust is not None:
            distrust(tenant)

    def index_evictor(self) -> IndexEvictor:
        """A synchronous view of the index maintenance (``evict``, ``reset_index``), safe to call from another
        thread: what :class:`cpmemory.engines.eviction_sync.EvictionSync` drives from its subscriber thread.

        With a Redis store its evictions reach the tenant's shared decision state too (the engine's cache is the
        truth every worker's orders follow): called directly for a sync store, scheduled on the event loop this
        method is called from for an asyncio store (the proxy builds it in its loop).
        """
        return IndexEvictor(self, shared_evictions(getattr(self, "store", None)))

    def check_index(self, tenant: str = "default") -> None:
        """Check the tenant's index invariants (raises IndexIntegrityError on corruption; for tests and tools)."""
        self._indexes.check_integrity(_tenant(tenant))

    def index_size(self, tenant: str = "default") -> int:
        """Number of requests in the tenant's index."""
        return self._indexes.size(_tenant(tenant))


SharedEvict = Callable[[str, list[str]], None]


def shared_evictions(store: Any) -> SharedEvict | None:
    """How evictions reach ``store``'s shared decision state from any thread (None: the store has none).

    A store failure is logged, never raised: the shared state then keeps those requests' weight until they age
    out (and a gap makes the next decision distrust it anyway).
    """
    evict = getattr(store, "evict_decisions", None)
    if evict is None:
        return None
    if inspect.iscoroutinefunction(evict):
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None  # no loop to run the asyncio store on: the local index only

        def done(future: concurrent.futures.Future[Any]) -> None:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                logger.warning("shared decision state not updated for evictions: %s", error)

        def run_async(tenant: str, request_ids: list[str]) -> None:
            try:
                asyncio.run_coroutine_threadsafe(evict(tenant, request_ids), loop).add_done_callback(done)
            except RuntimeError as error:  # the loop is closed (shutdown)
                logger.warning("shared decision state not updated for %d evictions: %s", len(request_ids), error)

        return run_async

    def run(tenant: str, request_ids: list[str]) -> None:
        try:
            evict(tenant, request_ids)
        except Exception as error:
            if not is_store_failure(error):
                raise
            logger.warning("shared decision state not updated for %d evictions: %s", len(request_ids), error)

    return run


class IndexEvictor:
    """Synchronous index maintenance of a facade (sync or async): evictions and resets."""

    __slots__ = ("_core", "_shared")

    def __init__(self, core: FacadeCore, shared: SharedEvict | None = None) -> None:
        """Wrap a facade; ``shared`` also evicts from its store's shared decision state (see :func:`shared_evictions`)."""
        self._core = core
        self._shared = shared

    def evict(self, request_ids: Iterable[str], *, tenant: str = "default") -> int:
        """Remove the leaves of ``request_ids`` from the tenant's index (and its shared decision state). Returns
        how many index leaves were removed."""
        if not isinstance(request_ids, (str, bytes, Mapping)) and isinstance(request_ids, Iterable):
            request_ids = list(request_ids)
        removed = self._core._evict(request_ids, tenant)  # validates request_ids
        if self._shared is not None and request_ids:
            self._shared(tenant, list(request_ids))  # type: ignore[arg-type]
        return removed

    def reset_index(self, tenant: str | None = None) -> None:
        """Drop one tenant's index (or all of them)."""
        self._core._reset_index(tenant)


def _tenant(tenant: Any) -> str:
    """``tenant``, validated like a conversation's (InvalidIdentifierError)."""
    return ConversationKey(tenant, "index").tenant


class _NoIndex(TenantIndexes):
    """Index stand-in used after an index failure: no prefix, nothing inserted."""

    def __init__(self) -> None:
        super().__init__(alpha=0.0, max_leaves=1)

    def place(self, tenant: str, context: Sequence[Any], request_id: str) -> Placement:
        return Placement()
