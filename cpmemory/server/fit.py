"""Cache-fit admission: a replica serves at once only the conversations whose histories fit its KV cache; the others'
turns wait in the proxy.

::

    turn without history (a lone question, a first turn) ─► the router's choice at once          ("first")
    later turn of conversation c
      ├─ c is live on replica r and *resident* there ──────────────────────► r at once            ("live")
      ├─ c is live on r, not resident (the older ones fill the cache)
      │    ├─ another replica has room for it now (``move``) ─────────────► that replica at once  ("moved")
      │    └─ else wait until it is resident on r, or another has room ─► r, or that one         ("resumed", "moved")
      ├─ c idled out but its next turn came within ``idle_s`` of its last answer: live again, in its old place ─► as above
      └─ c is not live (it idled out, or the proxy restarted): a replica (the router's choice first, then the most room) whose live
         conversations' footprints + c's fit ─► it at once                                       ("room")
         none fits, or other new ones already wait ─► wait (first come first served) ─► it         ("room")
      any wait longer than max_wait_s ─► sent anyway (its replica, or the router's choice)         ("timeout")

Why. An engine's prefix cache keeps a conversation's history for its next turn only while the histories of the
conversations it serves together fit; past that, LRU eviction takes the oldest history first, which in a round-robin
interleaving is the next one needed: every turn re-prefills its whole history (thrashing). Closed-loop agents send
turn n+1 as soon as turn n is answered, so serving at once only what the cache holds costs no engine time (a
single-core engine prefills no faster with more requests in flight) and saves the re-prefills. This is load control
against thrashing, as for virtual memory (Denning's working sets): vLLM's scheduler admits by the free blocks of the
requests it runs, not by the histories it will be asked to extend, so it lives in the proxy, where conversations are
known.

A conversation is *live* on its replica from its first admitted turn until it has had no turn in flight or waiting for
``idle_s`` (an agent's next turn comes within milliseconds; a human's, seconds later, enters again and usually finds
its replica by affinity; the next turn's arrival at the proxy restarts the window, ``touch``, so the time the proxy
spends holding and preparing it does not count); one that has had a single turn so far (a lone question, or a first turn) stays only
``first_idle_s``, so independent questions do not hold the cache for turns that never come. Live conversations are kept in admission order; the *resident* ones are those that fit, taken
first fit in that order within ``fill`` times the replica's KV cache (the oldest always). Conversations grow, so a
resident one may stop being resident when an older one grows: its turns then wait until the older ones end. A new
conversation enters a replica only when every live one there (resident or waiting) plus it fit, so it never overtakes
a waiting one. A *footprint* is the engine tokens of the conversation's latest prompt plus its answer: the engine's
usage once a turn is answered, else the prompt's characters times the tokens per character observed so far.

A conversation whose share the learnt window released early (its next turn came later than the window, within
``idle_s``) takes its old place back when that turn arrives: its history is still in its replica's cache, and
entering again at the back would make it the one that waits (and loses that history) once the others grow.

A live conversation that is not resident on its replica *moves* (``move``, on by default) to another replica where
every live conversation plus it fit, at once or while it waits, if no new conversation waits for room: its history is
recomputed there, which costs one prefill; waiting instead costs the time until the older conversations end (seconds:
they are the ones that take several turns more) and usually that history too, because vLLM's LRU evicts the blocks
of the turn not being run. Which replica a conversation should start on cannot be known from its first turn (its
size comes later); moving corrects the deal once the sizes are seen.

A replica whose capacity is unknown admits everything; nobody waits longer than ``max_wait_s`` (the fallback is
vLLM's own behaviour); a waiter whose client goes away leaves the queue. Admission decides only when and where a turn
is sent, never its content.

Use from one event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from cpmemory.server.clock import Clock, LoopClock, Timer
from cpmemory.server.fit_slot import (  # noqa: F401 - an admitted turn's slot and header, re-exported
    FIT_HEADER,
    FIT_REASONS,
    UNGATED,
    FitObserver,
    FitReason,
    FitSlot,
    NullFitObserver,
    parse_fit_header,
)

logger = logging.getLogger(__name__)

DEFAULT_TOKENS_PER_CHAR = 0.25
"""Tokens per character before a prompt was counted (about 4 characters per token)."""
CALIBRATION_MIN_CHARS = 1_000
"""A prompt this long or longer may set the tokens per character from its count (:meth:`CacheFit.calibrate`): on a
shorter one the chat template's own tokens weigh too much."""

GAP_SAMPLES = 128
"""Continuation gaps kept (the latest): a turn's end to its conversation's next turn reaching the proxy."""
GAP_MIN_SAMPLES = 16
"""Gaps seen before the idle window is learnt from them (``idle_s`` until then)."""
GAP_MARGIN = 1.25
"""The learnt window is this times the longest kept gap..."""
GAP_FLOOR_S = 0.1
"""... and never shorter than this."""
ENDED_KEYS = 4096
"""Conversations whose last turn's end is remembered (to time their next turn, live or not)."""


@dataclass(frozen=True, slots=True)
class FitSettings:
    """Cache-fit admission's tunables (``ServerConfig.fit`` and its ablations).

    Attributes:
        fill: the share of a replica's KV cache the live footprints may take.
        idle_s: how long a conversation with nothing in flight stays live (the longest learnt window).
        first_idle_s: the same while it has had one turn (a single question frees its share soon).
        grace_s: a replica with no turn in flight this long (and at least the idle window, ``CacheFit._grace``)
            takes the next new conversation even over ``fill`` (it would idle otherwise).
        max_wait_s: the longest a turn waits.
        learn_idle: the idle windows shrink to what the traffic needs (``CacheFit.idle_window_s``).
        move: a live conversation that is not resident moves to a replica with room rather than wait.
    """

    fill: float = 0.9
    idle_s: float = 0.5
    first_idle_s: float = 0.5
    grace_s: float = 0.1
    max_wait_s: float = 30.0
    learn_idle: bool = True
    move: bool = True


@dataclass(slots=True)
class _Live:
    replica: int
    footprint: int
    in_flight: int = 0
    waiting: int = 0
    idle_since: float | None = None
    turns: int = 0
    seq: int = 0  # admission order (first admitted turn); kept when an idled-out conversation takes its place back


@dataclass(slots=True, eq=False)
class _Waiter:
    key: str
    tokens: int
    ranked: tuple[int, ...]
    since: float
    future: asyncio.Future[FitSlot]
    live: _Live | None  # set: a live conversation's turn waiting to be resident again; None: a new conversation
    timer: Timer | None = None


class CacheFit:
    """Per-replica admission of conversations by the KV cache their histories need (see the module)."""

    def __init__(self, capacities: Sequence[int | None], settings: FitSettings | None = None, *,
                 clock: Clock | None = None, observer: FitObserver | None = None) -> None:
        """``capacities``: each replica's KV cache in tokens (None: unknown, that replica admits everything);
        ``settings``: the tunables (:class:`FitSettings`); ``clock``: the time and timers (the event loop's by
        default; a :class:`~cpmemory.server.clock.ManualClock` in tests). No IO."""
        settings = settings or FitSettings()
        fill, idle_s = settings.fill, settings.idle_s
        if not 0 < fill <= 1:
            raise ValueError("fill must be in (0, 1]")
        self.capacities = list(capacities)
        self.fill = fill
        self.idle_s = idle_s
        self.first_idle_s = min(settings.first_idle_s, idle_s)
        self.grace_s = settings.grace_s
        self.max_wait_s = settings.max_wait_s
        self._quiet_since: dict[int, float] = {}  # replica -> when its last turn in flight ended
        self._clock: Clock = clock or LoopClock()
        self._observer = observer or NullFitObserver()
        self._live: dict[str, _Live] = {}
        self._waiters: deque[_Waiter] = deque()
        self._timer: Timer | None = None
        self.tokens_per_char = DEFAULT_TOKENS_PER_CHAR
        self._calibrated = False  # tokens_per_char was set by a count before any answer (calibrate)
        self.learn_idle = settings.learn_idle
        self.move_enabled = settings.move
        self._ended: OrderedDict[str, float] = OrderedDict()  # conversation -> when its last turn ended
        self._gaps: deque[float] = deque(maxlen=GAP_SAMPLES)
        self._window_s = idle_s  # idle_window_s, recomputed only when a gap is seen (it is read per live conversation)
        self._expired: OrderedDict[str, _Live] = OrderedDict()  # idled out within idle_s: may take their place back
        self._seq = 0

    @property
    def sized(self) -> bool:
        """Whether any replica's capacity is known (else admission admits everything: the proxy skips it)."""
        return any(capacity is not None for capacity in self.capacities)

    @property
    def waiting(self) -> int:
        """Turns waiting for room now."""
        return sum(1 for waiter in self._waiters if not waiter.future.done())

    def replica_of(self, key: str) -> int | None:
        """The replica conversation ``key`` is live on, or None."""
        live = self._live.get(key)
        return None if live is None else live.replica

    def live_tokens(self, replica: int) -> int:
        """The footprints of the conversations live on ``replica`` (idle ones included until they expire)."""
        return sum(live.footprint for live in self._live.values() if live.replica == replica)

    def live_conversations(self, replica: int) -> int:
        """Conversations live on ``replica``."""
        return sum(1 for live in self._live.values() if live.replica == replica)

    def set_capacity(self, replica: int, tokens: int | None) -> None:
        """Change one replica's capacity (read from the engine); waiters are re-checked."""
        self.capacities[replica] = tokens
        self._pump()

    def by_room(self, replicas: Sequence[int]) -> list[int]:
        """``replicas`` ordered by the most room first (unknown capacity counts as unbounded)."""
        return sorted(dict.fromkeys(replicas), key=self._free, reverse=True)

    def move(self, key: str, replica: int) -> None:
        """Conversation ``key`` is served by ``replica`` (learnt after the fact, e.g. behind a gateway from the
        replicas' KV events): its share counts there from now on, and the waiters are re-checked."""
        live = self._live.get(key)
        if live is None or live.replica == replica or not 0 <= replica < len(self.capacities):
            return
        old = live.replica
        live.replica = replica
        if live.in_flight:
            self._quiet_since.pop(replica, None)
            if not any(other.in_flight for other in self._live.values() if other.replica == old):
                self._quiet_since[old] = self._clock.now()
        self._pump()

    def touch(self, key: str) -> None:
        """Conversation ``key``'s next turn reached the proxy: its idle window restarts, so the time the proxy spends
        preparing the turn (and tokenizing it) does not make it lose its place before the turn is admitted. The
        time since its last turn ended is a continuation gap (:meth:`idle_window_s`)."""
        now = self._clock.now()
        ended = self._ended.pop(key, None)
        continuation = False  # else a person's return after idle_s, or no turn of it ended before
        if ended is not None and now - ended <= self.idle_s:
            continuation = True
            self._gaps.append(now - ended)
            if self.learn_idle and len(self._gaps) >= GAP_MIN_SAMPLES:
                self._window_s = min(self.idle_s, max(GAP_FLOOR_S, GAP_MARGIN * max(self._gaps)))
            self._observer.fit_idle_window(self._window_s)
        live = self._live.get(key)
        if (live is not None and live.idle_since is not None and live.in_flight == 0
                and now - live.idle_since < self._idle_window(live)):
            live.idle_since = now
        ghost = self._expired.pop(key, None)
        if ghost is not None and continuation:  # its place is kept while the turn is prepared (_take_place_back)
            ghost.idle_since = now
            self._expired[key] = ghost

    def idle_window_s(self) -> float:
        """How long a conversation with nothing in flight stays live: ``idle_s``, or, learnt (``learn_idle``) once
        ``GAP_MIN_SAMPLES`` continuation gaps were seen, ``GAP_MARGIN`` times the longest of the latest
        ``GAP_SAMPLES`` (at least ``GAP_FLOOR_S``, at most ``idle_s``).

        Why. A conversation's share of the cache is held for its next turn during the window, and turns of other
        conversations that wait for room wait that long after it ended: a window longer than the traffic's gaps
        is pure waiting. An agent's next turn follows its answer within tens of milliseconds to a few hundred on
        a loaded machine, a person's seconds later; only gaps up to ``idle_s`` are kept, so a person's turn never
        stretches the window, and gaps are timed for every conversation whose turn ended (remembered whether or not
        it is still live), so a window that became too short still sees the longer gaps and grows back."""
        return self._window_s

    @property
    def calibrated(self) -> bool:
        """Whether the tokens per character were set by a count of a prompt before any answer (:meth:`calibrate`)."""
        return self._calibrated

    def calibrate(self, chars: int, tokens: int) -> None:
        """Set the tokens per character from one prompt of ``chars`` characters counted at ``tokens`` tokens (a
        tokenizer's count, before the prompt is sent). Only the first count of a prompt of ``CALIBRATION_MIN_CHARS``
        or more sets it; later ones, and shorter prompts, change nothing (the answers' usage moves it from then on,
        :meth:`_learn`).

        Why: the default, about four characters a token, can be far off for a given tokenizer, and moved a fifth of
        the way per answer the estimate takes many answers to get near; meanwhile the hold's token bound would let a
        burst's first requests in by the default, more prompt tokens than the caches hold, unplanned."""
        if self._calibrated or chars < CALIBRATION_MIN_CHARS or tokens <= 0:
            return
        self.tokens_per_char = tokens / chars
        self._calibrated = True

    def _learn(self, chars: int, prompt_tokens: int) -> None:
        """An answered prompt of ``chars`` characters that the engine counted at ``prompt_tokens``: the tokens per
        character move a fifth of the way to it (slowly: prompts differ)."""
        if chars > 0:
            self.tokens_per_char += 0.2 * (prompt_tokens / chars - self.tokens_per_char)

    def estimate(self, chars: int, answer_tokens: int) -> int:
        """A turn's footprint before the engine counted it: its prompt's characters and its answer's tokens."""
        return int(chars * self.tokens_per_char) + max(0, answer_tokens)

    async def admit(self, key: str, chars: int, answer_tokens: int, ranked: Sequence[int], *,
                    history: bool = True) -> FitSlot:
        """Admit one turn of conversation ``key`` (a prompt of ``chars`` characters, at most ``answer_tokens``
        generated), to one of ``ranked`` (the healthy replicas, the router's choice first). Waits while it may not
        run (at most ``max_wait_s``); a cancelled wait leaves the queue.

        ``history=False`` (a turn without conversation history: a lone question or a first turn) never waits: it
        has no cached history to protect, and the router's prefix choice serves it best. It is counted (its
        footprint is in the cache) on the router's choice (``"first"``)."""
        now = self._clock.now()
        self._expire(now)
        tokens = self.estimate(chars, answer_tokens)
        live = self._live.get(key)
        if not history:
            first = live.replica if live is not None and live.replica in ranked else (ranked[0] if ranked else 0)
            if live is not None and live.replica != first:
                del self._live[key]
            return self._enter(key, tokens, first, "first", 0.0, chars)
        if live is not None and ranked and live.replica not in ranked:  # its replica left rotation: start over
            del self._live[key]
            live = None
        if live is None:
            live = self._take_place_back(key, now, ranked)
        if live is not None:
            live.footprint = max(live.footprint, tokens)
            if key in self._resident(live.replica):
                return self._enter(key, tokens, live.replica, "live", 0.0, chars)
            target = self._move_target(live, ranked)
            if target is not None:
                live.replica = target
                return self._enter(key, tokens, target, "moved", 0.0, chars)
            return await self._wait(key, tokens, tuple(ranked), chars, live)
        order = self._ranked(ranked)
        if not any(waiter.live is None for waiter in self._waiters):
            replica = self._room(tokens, order)
            if replica is not None:
                return self._enter(key, tokens, replica, "room", 0.0, chars)
        return await self._wait(key, tokens, tuple(order), chars, None)

    # -- internals ---------------------------------------------------------------------------------------------

    def _take_place_back(self, key: str, now: float, ranked: Sequence[int]) -> _Live | None:
        """An idled-out conversation whose next turn came within ``idle_s`` of its last answer is live again, in its
        old place of the admission order (None: none such, or its replica left rotation)."""
        ghost = self._expired.pop(key, None)
        if (ghost is None or now - (ghost.idle_since or 0.0) > self.idle_s
                or (ranked and ghost.replica not in ranked)):
            return None
        ghost.idle_since = now
        self._live[key] = ghost
        if any(other.seq > ghost.seq for other in self._live.values()):
            self._live = dict(sorted(self._live.items(), key=lambda item: item[1].seq))
        return ghost

    def _move_target(self, live: _Live, ranked: Sequence[int], waiting: int = 0) -> int | None:
        """The replica of ``ranked`` (most room first) that a non-resident live conversation moves to: one where every
        live conversation plus its footprint fit (or none is live), while no new conversation waits for room (it
        would be overtaken) and no other turn of it is in flight or waiting (``waiting``: its turns in the queue
        that ask); else None."""
        if not self.move_enabled or live.in_flight or live.waiting > waiting:
            return None
        if any(waiter.live is None and not waiter.future.done() for waiter in self._waiters):
            return None
        others = self.by_room([index for index in ranked if index != live.replica])
        return next((replica for replica in others if self._fits(replica, live.footprint)), None)

    def _grace(self) -> float:
        """How long a replica must have been quiet to take a new conversation over ``fill``: ``grace_s``, and never
        less than the idle window (a replica is quiet between its conversations' turns too: taking a newcomer over
        the fill then evicts the histories of the turns about to come)."""
        return max(self.grace_s, self._window_s)

    async def _wait(self, key: str, tokens: int, ranked: tuple[int, ...], chars: int, live: _Live | None) -> FitSlot:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(key, tokens, ranked, self._clock.now(), loop.create_future(), live)
        waiter.timer = self._clock.call_later(self.max_wait_s, self._timeout, waiter)
        if live is not None:
            live.waiting += 1
        self._waiters.append(waiter)
        self._observer.fit_waiting(self.waiting)
        self._arm()
        try:
            slot = await asyncio.shield(waiter.future)
        except asyncio.CancelledError:
            self._leave(waiter)
            raise
        slot.chars = chars
        return slot

    def _ranked(self, ranked: Sequence[int]) -> list[int]:
        """The router's choice first, then the others by the most room."""
        if not ranked:
            return []
        first = ranked[0]
        rest = [replica for replica in dict.fromkeys(ranked[1:]) if replica != first]
        rest.sort(key=self._free, reverse=True)
        return [first, *rest]

    def _limit(self, replica: int) -> float | None:
        capacity = self.capacities[replica] if 0 <= replica < len(self.capacities) else None
        return None if capacity is None else self.fill * capacity

    def _free(self, replica: int) -> float:
        limit = self._limit(replica)
        return float("inf") if limit is None else limit - self.live_tokens(replica)

    def _room(self, tokens: int, order: Sequence[int]) -> int | None:
        """The first replica of ``order`` where every live conversation plus ``tokens`` fit (or none is live), else
        the first one that has been idle for ``grace_s`` (work-conserving: an idle engine serves no cache)."""
        for replica in order:
            if self._fits(replica, tokens):
                return replica
        now = self._clock.now()
        for replica in order:
            quiet = self._quiet_since.get(replica)
            if quiet is not None and now - quiet >= self._grace():
                return replica
        return None

    def _fits(self, replica: int, tokens: int) -> bool:
        """Whether every live conversation of ``replica`` plus ``tokens`` fit its limit (or none is live there)."""
        limit = self._limit(replica)
        used = self.live_tokens(replica)
        return limit is None or used == 0 or used + tokens <= limit

    def _resident(self, replica: int) -> set[str]:
        """The live conversations of ``replica`` that fit its cache: first fit in admission order (the oldest
        always)."""
        limit = self._limit(replica)
        resident: set[str] = set()
        used = 0
        for key, live in self._live.items():
            if live.replica != replica:
                continue
            if limit is None or not resident or used + live.footprint <= limit:
                resident.add(key)
                used += live.footprint
        return resident

    def _enter(self, key: str, tokens: int, replica: int, reason: FitReason, waited_s: float, chars: int) -> FitSlot:
        live = self._live.get(key)
        if live is None:
            self._seq += 1
            live = self._live[key] = _Live(replica, tokens, seq=self._seq)
        live.in_flight += 1
        live.turns += 1
        live.idle_since = None
        live.footprint = max(live.footprint, tokens)
        self._quiet_since.pop(replica, None)
        self._observer.fit_admitted(reason, waited_s)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("admit %s -> %d (%s, waited %.3f s, %d tokens); live tokens %s", key, replica, reason, waited_s,
                         tokens, [self.live_tokens(index) for index in range(len(self.capacities))])
        return FitSlot(self, key, replica, reason, waited_s, chars)

    def _end(self, slot: FitSlot, replica: int | None, prompt_tokens: int | None, answer_tokens: int) -> None:
        live = self._live.get(slot.key)
        if live is not None:
            live.in_flight = max(0, live.in_flight - 1)
            if replica is not None and replica >= 0:
                live.replica = replica  # a failover moved it
            if prompt_tokens:
                live.footprint = prompt_tokens + max(0, answer_tokens)
                self._learn(slot.chars, prompt_tokens)  # the engine's tokens per character
            if live.in_flight == 0:
                live.idle_since = self._clock.now()
                self._ended[slot.key] = live.idle_since
                self._ended.move_to_end(slot.key)
                if len(self._ended) > ENDED_KEYS:
                    self._ended.popitem(last=False)
            if not any(other.in_flight for other in self._live.values() if other.replica == live.replica):
                self._quiet_since[live.replica] = self._clock.now()
        self._pump()

    def _expire(self, now: float) -> None:
        gone = [key for key, live in self._live.items()
                if live.in_flight == 0 and live.waiting == 0 and live.idle_since is not None
                and now - live.idle_since >= self._idle_window(live)]
        for key in gone:
            self._expired[key] = self._live.pop(key)
            self._expired.move_to_end(key)
        while len(self._expired) > ENDED_KEYS:
            self._expired.popitem(last=False)

    def _idle_window(self, live: _Live) -> float:
        return min(self._window_s, self.idle_s if live.turns > 1 else self.first_idle_s)

    def _pump(self) -> None:
        """Let the waiters run that may now: a live one once it is resident; new ones first come first served
        (the oldest new one waits for room and no newer one overtakes it)."""
        self._expire(self._clock.now())
        moved = True
        while moved:  # a move makes room where the conversation was: check the queue again
            moved = self._pump_once()
        self._observer.fit_waiting(self.waiting)
        self._arm()

    def _pump_once(self) -> bool:
        """One pass over the queue; True when a conversation moved."""
        moved = False
        blocked_new = False
        for waiter in list(self._waiters):
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            if waiter.live is not None:
                if waiter.live is not self._live.get(waiter.key):
                    continue
                if waiter.key in self._resident(waiter.live.replica):
                    self._grant(waiter, waiter.live.replica, "resumed")
                    continue
                target = self._move_target(waiter.live, waiter.ranked, waiting=1)
                if target is not None:
                    waiter.live.replica = target
                    self._grant(waiter, target, "moved")
                    moved = True
                continue
            if blocked_new:
                continue
            replica = self._room(waiter.tokens, self._ranked(waiter.ranked))
            if replica is None:
                blocked_new = True
                continue
            self._grant(waiter, replica, "room")
        return moved

    def _grant(self, waiter: _Waiter, replica: int, reason: FitReason) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        if waiter.live is not None:
            waiter.live.waiting = max(0, waiter.live.waiting - 1)
        slot = self._enter(waiter.key, waiter.tokens, replica, reason, self._clock.now() - waiter.since, 0)
        waiter.future.set_result(slot)

    def _timeout(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        replica = waiter.live.replica if waiter.live is not None else waiter.ranked[0] if waiter.ranked else 0
        self._grant(waiter, replica, "timeout")
        self._pump()

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter was cancelled: leave the queue, or give back the slot granted at the same moment."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        if waiter.future.done() and not waiter.future.cancelled():
            waiter.future.result().end()
        else:
            waiter.future.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if waiter.live is not None:
                waiter.live.waiting = max(0, waiter.live.waiting - 1)
                if waiter.live.in_flight == 0 and waiter.live.idle_since is None:
                    waiter.live.idle_since = self._clock.now()
        self._pump()

    def _arm(self) -> None:
        """While turns wait, wake up when the next idle conversation expires."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.waiting:
            return
        wakeups = [live.idle_since + self._idle_window(live) for live in self._live.values()
                   if live.in_flight == 0 and live.idle_since is not None]
        grace = self._grace()
        wakeups += [quiet + grace for quiet in self._quiet_since.values()]
        # A time already past was seen by the pump that just ran (an idle conversation whose own turn waits is not
        # expired; a quiet replica's grace is for new conversations): re-arming for it would pump every millisecond
        # until the waiter is served. Every other change (a turn admitted or ended, a move) pumps by itself.
        now = self._clock.now()
        upcoming = [wakeup for wakeup in wakeups if wakeup > now]
        if not upcoming:
            return
        self._timer = self._clock.call_later(min(upcoming) - now + 0.001, self._pump)
