"""Send a call to the replica its affinity key chooses, failing over to the next one when a replica is down.

The dispatcher joins the ``Router`` (where to go) and a ``ChatTransport`` (how to get there): it counts the call in
flight, marks a replica down on ``EngineUnreachableError`` and tries the key's next replica, at most once per
replica. An ``EngineStatusError`` (the engine answered, with an error) is not retried: the request itself is at fault.
Streaming calls fail over only before the first byte; once bytes flow, an error reaches the caller.

A ``RouteHint`` (the prompt's blocks, whether the key is sticky) lets the router score replicas by their cached
prefix; the replica that accepted the call is recorded for the key (affinity) and in the router's prefix view.

A replica marked down is logged once per outage with the error that took it out. When *every* replica is marked
down, a call checks them before it gives up (``Router.probe``: one check at a time for all callers, at most once per
``REVIVE_INTERVAL_S``): a passing failure, such as one open that failed on each replica during a burst, would
otherwise refuse every call with ``no_healthy_replica`` until the periodic probe, while the engines are up. A call
still never tries the same replica twice.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cpmemory.errors import EngineError, EngineUnreachableError, NoHealthyReplicaError
from cpmemory.routing.prefix import PromptBlocks, new_tokens, uncached_tokens
from cpmemory.routing.router import RouteDecision, Router, RouteReason
from cpmemory.routing.transport import ChatTransport, EngineStream

_T = TypeVar("_T")
logger = logging.getLogger(__name__)

REVIVE_INTERVAL_S = 1.0
"""With every replica marked down, the replicas are checked again at most this often (calls in between fail at
once: a fleet that is really down still answers ``no_healthy_replica`` within a health check's time)."""


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the router may use beyond the key.

    Attributes:
        prompt: the prompt's blocks (prefix scoring).
        sticky: the key's earlier calls carry this call's context: go back to the key's replica.
        remember: record the key's replica for its later sticky calls (a conversation, a job; not a prefix key).
        replica: the replica the proxy placed the call on (its first try; failover as usual).
        placed_by: who placed it there: ``fit`` (cache-fit admission) or ``lane`` (a held window's split).
    """

    prompt: PromptBlocks | None = None
    sticky: bool = False
    remember: bool = True
    replica: int | None = None
    placed_by: RouteReason = "fit"


NO_HINT = RouteHint()


@dataclass(frozen=True, slots=True)
class DispatchResult:
    """A finished non-streaming call.

    Attributes:
        response: the engine's JSON body.
        decision: the replica that answered, and why it was chosen.
        failovers: replicas tried (and marked down) before this one.
        engine_seconds: wall time spent waiting on engines, every attempt included.
    """

    response: dict[str, Any]
    decision: RouteDecision
    failovers: int
    engine_seconds: float


@dataclass(slots=True)
class StreamDispatch:
    """An open streaming call. ``release()`` must be called once the stream is consumed or abandoned."""

    stream: EngineStream
    decision: RouteDecision
    failovers: int
    engine_seconds: float
    _router: Router
    _released: bool = False

    async def release(self) -> None:
        """Close the stream and stop counting the call in flight (idempotent)."""
        if self._released:
            return
        self._released = True
        self._router.end(self.decision.url)
        await self.stream.aclose()


def engine_priority(decision: RouteDecision, prompt: PromptBlocks | None, payload: Mapping[str, Any]) -> int:
    """vLLM's ``priority`` for a call sent to ``decision``'s replica (lower is served first; ties by arrival): the
    prompt tokens that replica must still compute, so a replica whose queue holds requests it has mostly cached
    serves those first (shortest prefill first, SGLang's longest-prefix-match order); their prefixes are then used
    before later prompts evict them. Without the prompt's blocks (a conversation's later turn kept on its replica)
    the messages after the last answer stand for it: the history is that replica's cached prefix. Pure."""
    if prompt is not None:
        return uncached_tokens(prompt, decision.cached_blocks)
    return new_tokens(payload.get("messages") or [])


class Dispatcher:
    """Routes calls by affinity key, with failover. Use from one event loop."""

    def __init__(
        self,
        router: Router,
        transport: ChatTransport,
        *,
        timeout_s: float = 120.0,
        on_failover: Callable[[RouteDecision], None] | None = None,
        on_decision: Callable[[RouteDecision], None] | None = None,
        failover: bool = True,
        priority: bool = False,
    ) -> None:
        """Wire a router to a transport; no IO.

        ``on_failover`` is called with each replica marked down, ``on_decision`` with each replica that accepted a
        call (metrics). ``failover=False`` (one gateway in front of the replicas): an unreachable engine is never
        marked down nor retried here; its ``EngineUnreachableError`` reaches the caller. ``priority``: each call
        carries vLLM's ``priority`` (lower first), the tokens its replica must still compute (``engine_priority``).
        """
        self.failover = failover
        self.priority = priority
        self.router = router
        self.transport = transport
        self.timeout_s = timeout_s
        self._on_failover = on_failover
        self._on_decision = on_decision
        self._revive: asyncio.Future[list[str]] | None = None  # the check of a fleet marked down, shared by callers
        self._revived_at = float("-inf")

    async def complete(
        self, key: str, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None,
        hint: RouteHint = NO_HINT,
    ) -> DispatchResult:
        """Send a non-streaming chat completion for ``key``; fail over on unreachable replicas.

        Raises:
            NoHealthyReplicaError: every replica is down (or failed during this call).
            EngineStatusError: the engine rejected the request (not retried).
        """

        async def send(url: str, body: Mapping[str, Any]) -> dict[str, Any]:
            return await self.transport.complete(url, body, headers or {}, self.timeout_s)

        response, decision, failovers, waited = await self._with_failover(key, payload, send, hint,
                                                                          keep_in_flight=False)
        return DispatchResult(response, decision, failovers, waited)

    async def open_stream(
        self, key: str, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None,
        hint: RouteHint = NO_HINT,
    ) -> StreamDispatch:
        """Open a streaming chat completion for ``key``; fail over until a replica accepts it.

        The call stays counted in flight until ``StreamDispatch.release()``.
        """

        async def send(url: str, body: Mapping[str, Any]) -> EngineStream:
            return await self.transport.open_stream(url, body, headers or {}, self.timeout_s)

        stream, decision, failovers, waited = await self._with_failover(key, payload, send, hint,
                                                                        keep_in_flight=True)
        return StreamDispatch(stream, decision, failovers, waited, self.router)

    async def _with_failover(
        self, key: str, payload: Mapping[str, Any], send: Callable[[str, Mapping[str, Any]], Awaitable[_T]],
        hint: RouteHint, *, keep_in_flight: bool,
    ) -> tuple[_T, RouteDecision, int, float]:
        """Run ``send`` on the key's replica, then on the next ones while they are unreachable.

        The attempt is counted in flight while it runs; on success it stays counted when ``keep_in_flight`` (the
        caller ends it). Returns the result, the replica that answered, the failovers and the time spent waiting.
        """
        tried: list[str] = []
        waited = 0.0
        revived = False
        while True:
            try:
                decision = self._choose(key, tried, hint)
            except NoHealthyReplicaError:
                if revived or not self.failover or not await self._revived():
                    raise
                revived = True  # some replica answered its health check: choose again (never one tried already)
                continue
            self.router.begin(decision.url)
            self.router.record(key, decision, hint.prompt, sticky=hint.remember)
            started = time.perf_counter()
            try:
                body = payload
                if self.priority and "priority" not in payload:
                    body = {**payload, "priority": engine_priority(decision, hint.prompt, payload)}
                result = await send(decision.url, body)
            except EngineUnreachableError as error:
                self.router.end(decision.url)
                if not self.failover:
                    raise
                self._fail(decision, tried, error)
                continue
            except BaseException:
                self.router.end(decision.url)
                raise
            finally:
                waited += time.perf_counter() - started
            if not keep_in_flight:
                self.router.end(decision.url)
            if self._on_decision is not None:
                self._on_decision(decision)
            return result, decision, len(tried), waited

    def _choose(self, key: str, tried: list[str], hint: RouteHint) -> RouteDecision:
        if hint.replica is not None and not tried:
            placed = self.router.placed(hint.replica, hint.prompt, hint.placed_by)
            if placed is not None:
                return placed
        try:
            return self.router.choose(key, exclude=tried, prompt=hint.prompt, sticky=hint.sticky)
        except NoHealthyReplicaError as error:
            if tried:
                raise NoHealthyReplicaError(f"every replica failed for this call ({len(tried)} tried)") from error
            raise

    async def _revived(self) -> bool:
        """Every replica is marked down: check them (one check shared by concurrent callers, at most once per
        ``REVIVE_INTERVAL_S``); True when one came back."""
        if self._revive is None:
            now = time.monotonic()
            if now - self._revived_at < REVIVE_INTERVAL_S:
                return False
            self._revived_at = now
            self._revive = asyncio.ensure_future(self.router.probe(self.transport.is_healthy))
        revive = self._revive
        try:
            recovered = await asyncio.shield(revive)
        finally:
            if revive.done() and self._revive is revive:
                self._revive = None
        if recovered:
            logger.warning("every engine replica was marked down; %s answered a health check and is back in rotation",
                           ", ".join(recovered))
        return bool(recovered)

    def _fail(self, decision: RouteDecision, tried: list[str], error: EngineError) -> None:
        if self.router.is_healthy(decision.url):
            logger.warning("engine replica %s marked down: %s", decision.url, error)
        self.router.mark_down(decision.url)
        tried.append(decision.url)
        if self._on_failover is not None:
            self._on_failover(decision)

    async def probe_forever(self, stop: asyncio.Event) -> None:
        """Probe down replicas every ``router.config.probe_interval_s`` until ``stop`` is set."""
        interval = self.router.config.probe_interval_s
        while not stop.is_set():
            await self.router.probe(self.transport.is_healthy)
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except asyncio.TimeoutError:
                continue
