"""Where a prepared turn goes, and when: the router's hint for its prompt, a split held window's lanes, cache-fit
admission, the hold's token estimate, eviction-sync registration and, behind a gateway, which replica served it.

:class:`TurnPlacement` holds that state; :class:`cpmemory.server.service.ProxyService` runs the turn through it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cpmemory.engines.openai_wire import session_params
from cpmemory.errors import NoHealthyReplicaError
from cpmemory.routing.dispatch import Dispatcher, RouteHint
from cpmemory.routing.fleet import FleetView
from cpmemory.routing.prefix import content_chars, text_blocks
from cpmemory.routing.router import conversation_affinity_key
from cpmemory.server.budget import EngineBudget, requested_answer_tokens
from cpmemory.server.fit import CALIBRATION_MIN_CHARS, UNGATED, CacheFit, FitSlot
from cpmemory.server.hold import Admission, HoldQueue
from cpmemory.server.metrics import ProxyMetrics
from cpmemory.server.schemas import ChatCompletionRequest
from cpmemory.server.turn_request import TurnInput, request_chars
from cpmemory.session.turns import PreparedTurn

logger = logging.getLogger(__name__)
MAX_SERVED_ON = 100_000
"""Conversations whose serving replica behind a gateway the proxy remembers (least recently served dropped first)."""
CALIBRATION_WAIT_S = 2.0
"""How long requests wait for the count that calibrates the token estimate (:meth:`TurnPlacement.calibrate_estimate`)
before they go on with the default; the count still lands when it answers."""


@dataclass(frozen=True, slots=True)
class _Registration:
    """What eviction sync needs of a sent prompt: where it went and what it was."""

    key: str
    request_id: str
    payload: Mapping[str, Any]
    tenant: str
    hint: RouteHint
    upstream: bool


class TurnPlacement:
    """Routing and admission state of one proxy app (use from one event loop)."""

    def __init__(self, dispatcher: Dispatcher, metrics: ProxyMetrics) -> None:
        """No IO; the app sets the optional parts (hold, fit, kv_sync, ...) once built."""
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.kv_sync: Any = None  # a KVSyncHub when the engines publish KV events (set by the app's lifespan)
        self.upstream = False  # True behind a gateway: it picks the replica, the proxy sends no routing hint
        self.upstream_session = False  # turns name their conversation to the gateway (ServerConfig.upstream_session)
        self.engine_budget: EngineBudget | None = None  # set by create_app (cpmemory.server.budget)
        self.answer_reserve_tokens = 1024  # answer tokens reserved when a request gives no max_tokens
        self.hold: HoldQueue | None = None  # the hold-and-release queue, when max_in_flight or hold_fit is set
        self.fit: CacheFit | None = None  # cache-fit admission, when the replicas' cache sizes are known (create_app)
        self.fleet: FleetView | None = None  # the replicas' records (the block orders the pick reads)
        self.gateway_replicas = 0  # behind a gateway: the replicas whose KV events tell where a conversation went
        self._served_on: OrderedDict[str, int] = OrderedDict()  # conversation key -> the replica that served it
        self._calibration: asyncio.Future[None] | None = None  # the one count that calibrates the estimate

    @property
    def needs_calibration(self) -> bool:
        """Whether a request should calibrate the token estimate (:meth:`calibrate_estimate`): the hold queue counts
        tokens (``hold.token_bound``: it decides on the estimate before any answer), cache-fit admission knows the caches'
        sizes, the proxy can count (``engine_budget``), and no count has answered or failed yet. Without
        the token bound the estimate is left to the answers, as before: first turns never wait for admission, so
        nothing decides on it before an answer."""
        fit, hold = self.fit, self.hold
        return (hold is not None and hold.counts_tokens and fit is not None and fit.sized and not fit.calibrated
                and self.engine_budget is not None and (self._calibration is None or not self._calibration.done()))

    async def calibrate_estimate(self, request: ChatCompletionRequest, turn: TurnInput | None) -> None:
        """While :attr:`needs_calibration`, count one request of ``CALIBRATION_MIN_CHARS`` characters or more (its
        messages, its blocks' texts added to the last one, so roles stay as the chat template expects them) to set
        cache-fit admission's tokens per character, which the hold's token bound uses: the local tokenizer when there is one, else the engine's ``/tokenize``. One count for the
        whole proxy: requests that arrive meanwhile wait for it, at most ``CALIBRATION_WAIT_S``; a count that fails
        is not retried (the answers' usage moves the estimate, as without the count).

        Why. The hold's token bound and cache-fit admission estimate a prompt's tokens from its
        characters before it is sent; until an answer came back that estimate was the default, four characters a
        token. A burst reaching a fresh proxy arrives before any answer: with a tokenizer denser than that
        default (the bench model's) the bound let in more prompts than the caches hold, unplanned."""
        counter, fit = self.engine_budget, self.fit
        if not self.needs_calibration or counter is None or fit is None:
            return
        chars = request_chars(request, turn)
        if chars < CALIBRATION_MIN_CHARS:
            return
        if self._calibration is None:
            messages = [{"role": message.role, "content": str(message.content or "")} for message in request.messages]
            if turn is not None and turn.blocks:
                texts = "\n\n".join(block.text for block in turn.blocks)
                if messages:
                    messages[-1]["content"] = f"{texts}\n\n{messages[-1]['content']}"
                else:
                    messages.append({"role": "user", "content": texts})
            self._calibration = asyncio.ensure_future(self._count_for_calibration(counter, fit, request.model,
                                                                                  messages, chars))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._calibration), CALIBRATION_WAIT_S)

    async def _count_for_calibration(self, counter: EngineBudget, fit: CacheFit, model: str,
                                     messages: Sequence[Mapping[str, str]], chars: int) -> None:
        tokens = await counter.count(model, messages)
        if tokens is None:
            self.metrics.fallbacks.labels(kind="calibrate").inc()
            return
        fit.calibrate(chars, tokens)
        logger.info("token estimate calibrated on one prompt: %.3f tokens per character", fit.tokens_per_char)

    async def route_hint(self, payload: Mapping[str, Any], sticky: bool, remember: bool = True,
                         key: str | None = None, placed: bool = False) -> RouteHint:
        """The router's hint for one engine payload: its prompt blocks (engine hashes when the replicas publish KV
        events and the view follows them, else character chunks) and whether its key is sticky.

        ``placed``: the call's replica is already decided (its split window's lane has one): no engine hashes are
        asked for (its prompt is registered for eviction sync after the answer). A ``/tokenize`` call waits behind
        the engine's prefill on its API server, seconds under a burst, and a released window is sent one request
        after the other: a slow one let the next ones overtake it (``SEND_TURN_S``) and the engines queued the lanes
        out of their planned order.

        Engine hashes cost a ``/tokenize`` call before the request can be sent; a sticky call whose replica the
        router keeps (``Router.sticky_replica``) skips it (its prompt is registered for eviction sync after the
        answer instead). A tokenization that fails gives no blocks: the router then keeps sticky keys where they
        are and routes the others by key (counted as the ``route_tokenize`` fallback).
        """
        router = self.dispatcher.router
        if self.upstream or router.view is None or router.config.policy == "affinity":
            return RouteHint(None, sticky, remember)
        if self.kv_sync is not None and getattr(self.kv_sync, "view", None) is router.view:
            if placed or (sticky and key is not None and router.sticky_replica(key) is not None):
                return RouteHint(None, sticky, remember)
            # the least loaded replica in rotation tokenizes (its API server is the least busy)
            healthy = [status.url for status in sorted(router.status(), key=lambda status: status.in_flight)
                       if status.healthy]
            blocks = await self.kv_sync.prompt_blocks(payload, healthy)
            if blocks is None:
                self.metrics.fallbacks.labels(kind="route_tokenize").inc()
            return RouteHint(blocks, sticky, remember)
        return RouteHint(text_blocks(payload.get("messages") or []), sticky, remember)

    def _lane_replica(self, admission: Admission | None, sticky: bool) -> tuple[int | None, bool]:
        """(the healthy replica the call's split-window lane runs on, or None; whether the call belongs to a lane the
        proxy places at all: split, not sticky, not behind a gateway)."""
        if admission is None or admission.lane is None or admission.lanes is None or self.upstream or sticky:
            return None, False
        router = self.dispatcher.router
        replica = admission.lanes.replica(admission.lane)
        return (replica if replica is not None and router.is_healthy(router.urls[replica]) else None), True

    def lane_placed(self, admission: Admission | None, sticky: bool) -> bool:
        """Whether the call's split-window lane already runs on a healthy replica (:meth:`lane_hint` will send it
        there without asking the router)."""
        return self._lane_replica(admission, sticky)[0] is not None

    def lane_hint(self, admission: Admission | None, key: str, hint: RouteHint) -> RouteHint:
        """The hint of a call whose held window was split over the replicas (``Admission.lane``): its lane's
        replica; the lane's first call claims the router's choice among the replicas no other lane of its release
        holds (any healthy one when all are held). A sticky call (its history is where it is), a call behind a
        gateway, or one not split: the hint unchanged."""
        replica, placed = self._lane_replica(admission, hint.sticky)
        if not placed:
            return hint
        assert admission is not None and admission.lanes is not None and admission.lane is not None
        if replica is None:
            router = self.dispatcher.router
            taken = [router.urls[index] for index in admission.lanes.taken(admission.lane)]
            try:
                try:
                    replica = router.choose(key, exclude=taken, prompt=hint.prompt).index
                except NoHealthyReplicaError:  # every free replica is down: share one with another lane
                    replica = router.choose(key, prompt=hint.prompt).index
            except NoHealthyReplicaError:
                return hint  # the dispatcher reports it
            admission.lanes.claim(admission.lane, replica)
        return replace(hint, replica=replica, placed_by="lane")

    def _name_session(self, body: dict[str, Any], key: str, admission: Admission | None = None,
                      sticky: bool = False) -> None:
        """Behind a gateway with ``upstream_session``: the turn names its conversation (``session_params``), or, a
        turn without history of a split held window, its lane (so the gateway keeps the lane on one replica)."""
        if self.upstream and self.upstream_session:
            lanes = admission.lanes if admission is not None else None
            if lanes is not None and admission is not None and admission.lane is not None and not sticky:
                key = lanes.session_key(admission.lane)
            body["session_params"] = session_params(key)

    def record_sent(self, replica: int | None, turn: TurnInput, prepared: PreparedTurn) -> None:
        """Note in the fleet's records (the order index the ``pick`` reads) the block order of a prompt sent to
        ``replica``, when the prompt opens its conversation (its blocks follow the system prompt, so their order is
        a prefix the engine caches). Nothing behind a gateway, for a degraded turn or with the view off."""
        fleet = self.fleet
        if fleet is None or not fleet.follow_orders or replica is None or self.upstream or prepared.degraded or not prepared.opens_conversation:
            return
        by_id = {block.id: block for block in turn.blocks}
        shown = [by_id[block_id] for block_id in prepared.prompt_order if block_id in by_id]
        fleet.send_order(replica, [block.content_hash for block in shown], [len(block.text) + 1 for block in shown])

    def arrived(self, tenant: str, turn: TurnInput) -> None:
        """A turn reached the proxy (before it is held and prepared): cache-fit admission keeps its conversation's
        place meanwhile (``CacheFit.touch``)."""
        if self.fit is not None:
            self.fit.touch(conversation_affinity_key(tenant, turn.conversation_id))

    async def place(self, key: str, payload: Mapping[str, Any], hint: RouteHint, request: ChatCompletionRequest
                    ) -> tuple[FitSlot, RouteHint]:
        """Cache-fit admission of a turn (cpmemory.server.fit): waits while no replica's cache has room for a new
        conversation; returns its slot and the hint, with the replica it was placed on. Off: at once, unchanged."""
        fit = self.fit
        router = self.dispatcher.router
        healthy = [status.index for status in router.status() if status.healthy]
        if fit is None or not fit.sized or not healthy:
            return UNGATED, hint
        if self.upstream and self.gateway_replicas:  # the gateway picks; its replica is known after a first turn
            known = self._served_on.get(key)
            ranked = [known] if known is not None else fit.by_room(range(self.gateway_replicas))
        elif self.upstream:  # the gateway picks the replica: one pool, the fleet's cache
            ranked = [0]
        elif hint.sticky and fit.replica_of(key) in healthy:  # a live conversation stays: no routing choice needed
            ranked = healthy
        elif hint.replica is not None and hint.replica in healthy:  # its lane's replica (a held window's split)
            ranked = [hint.replica, *(index for index in healthy if index != hint.replica)]
        else:
            try:
                first = router.choose(key, prompt=hint.prompt, sticky=hint.sticky).index
            except NoHealthyReplicaError:
                return UNGATED, hint
            ranked = [first, *(index for index in healthy if index != first)]
        chars = content_chars(payload.get("messages") or [])
        slot = await fit.admit(key, chars, requested_answer_tokens(request, self.answer_reserve_tokens), ranked,
                               history=hint.sticky)
        if self.upstream or slot.reason in ("first", "timeout"):  # the gateway's, or the router's choice
            return slot, hint
        if slot.reason == "room" and slot.replica == ranked[0] and not slot.waited_s:
            return slot, hint  # the router's choice, its view fresh
        return slot, replace(hint, replica=slot.replica, placed_by="fit")  # the conversation's (it may have moved)

    def _register(self, replica: int, sent: _Registration) -> None:
        """Register a committed prompt for eviction sync: its known hashes, else a background ``/tokenize``; behind
        a gateway whose replicas' events the proxy follows, find the replica that served it first (and count the
        conversation there for cache-fit admission)."""
        hub = self.kv_sync
        if hub is None:
            return
        if sent.upstream and self.gateway_replicas:
            hub.attribute_later(sent.request_id, sent.payload, sent.tenant,
                                lambda served: self._served(sent.key, served))
        elif sent.hint.prompt is not None and hub.view is not None and not sent.upstream:
            hub.register_hashes(replica, sent.request_id, sent.hint.prompt.keys, sent.tenant)
        else:
            hub.register_later(None if sent.upstream else replica, sent.request_id, sent.payload, sent.tenant)

    def _served(self, key: str, replica: int | None) -> None:
        """Behind a gateway: conversation ``key``'s last turn was served by ``replica`` (None: not found out)."""
        self.metrics.gateway_attributions.labels(replica="unknown" if replica is None else str(replica)).inc()
        if replica is None:
            return
        self._served_on[key] = replica
        self._served_on.move_to_end(key)
        while len(self._served_on) > MAX_SERVED_ON:
            self._served_on.popitem(last=False)
        if self.fit is not None:
            self.fit.move(key, replica)
