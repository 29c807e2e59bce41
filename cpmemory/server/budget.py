"""The proxy's token budget: what the engine can take, and the engine's own count of a prompt (issue 13).

The proxy keeps the limits of each model the engine lists (``GET /v1/models``: vLLM and SGLang report
``max_model_len``), asked once, and whether it offers ``POST /tokenize``; a request naming a model the engine does not
list is counted under the engine's first model (:meth:`EngineBudget.served_model`), so a client-chosen ``model``
string adds no entry and no engine call of its own (the list is asked again at most once per ``RETRY_AFTER_S``). A turn's budget is ``max_model_len - max_tokens`` (the request's
``max_tokens`` / ``max_completion_tokens``, else ``ServerConfig.answer_reserve_tokens``). The facade plans the prompt
under that budget with its counter (the default estimate); when the engine offers ``/tokenize``, the proxy then
counts the prompt exactly as the engine will (chat template applied) and, if the engine counts more than the budget,
plans the turn again under a budget scaled down by the ratio, up to ``MAX_REPLANS`` times; a turn that still does
not fit is a PromptBudgetError (400, nothing stored). To spare a call per turn, a prompt is counted only when its
planned size times the largest engine/planned ratio seen (``UNLEARNED_RATIO`` until ``LEARN_COUNTS`` prompts of the
model were counted, and never under 1) times ``COUNT_SLACK`` could exceed the budget, and never when the prompt's
UTF-8 bytes plus the template's tokens per message (the engine's count of a one-word chat, asked with the limits)
fit: no tokenizer whose tokens cover at least a byte each counts more (:meth:`EngineLimits.upper_bound`). Without
that bound, a burst of long prompts reaching a freshly started proxy, before any answer taught it the ratio, called
``/tokenize`` once per prompt, queued behind the burst at the engine's API server (with the limits also asked once
per request before :meth:`EngineBudget.limits` shared its check, each question of a burst spent seconds in
``prepare``; the bound and the shared check removed most of that wait). Every answered prompt is a count
too (its ``usage.prompt_tokens``); once learnt, the facade plans against the budget scaled by that ratio
(:meth:`EngineBudget.planning_budget`): the default counter over-counts common tokenizers by design, and planning
in its tokens against the engine's limit cut conversations' histories well short of the context. An engine that
answers neither gives no budget (the turn is planned as before) and is asked again after ``RETRY_AFTER_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cpmemory.engines.openai_wire import model_entry

logger = logging.getLogger(__name__)

MAX_REPLANS = 3
RETRY_AFTER_S = 60.0
REPLAN_MARGIN = 0.97
LEARN_COUNTS = 8
UNLEARNED_RATIO = 2.0
COUNT_SLACK = 1.25
LEARN_MIN_TOKENS = 512
PLAN_MARGIN = 0.97


_TEXT_MESSAGE_KEYS = frozenset({"role", "content", "name"})


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What one engine said about one model.

    Attributes:
        max_model_len: the context length in tokens (None: unknown).
        tokenize: True when ``POST /tokenize`` answered.
        checked_at: ``time.monotonic()`` of the check.
        template_tokens: the engine's count of a one-word chat (its template's own tokens, any default system
            prompt included, plus one): what a message can cost beyond its text (None: not counted).
    """

    max_model_len: int | None
    tokenize: bool
    checked_at: float
    template_tokens: int | None = None

    def upper_bound(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """A bound on the engine's count of a chat prompt that no tokenizer whose tokens each cover at least one byte
        of the text exceeds (byte-level BPE, SentencePiece with byte fallback, character-level): the texts' UTF-8
        bytes plus ``template_tokens`` per message; None when the template was not counted, or when a message
        carries more than text (parts such as images, tool calls: their tokens are not in its bytes). Pure; O(text)."""
        if self.template_tokens is None:
            return None
        text_bytes = 0
        for message in messages:
            content = message.get("content")
            if not set(message) <= _TEXT_MESSAGE_KEYS or not isinstance(content, (str, type(None))):
                return None
            text_bytes += len((content or "").encode("utf-8", "surrogatepass"))
        return text_bytes + self.template_tokens * max(1, len(messages))


def requested_answer_tokens(request: Any, default: int) -> int:
    """The answer tokens a chat request reserves: ``max_completion_tokens`` / ``max_tokens``, else ``default``."""
    extra = getattr(request, "model_extra", None) or {}
    for name in ("max_completion_tokens", "max_tokens"):
        value = extra.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def model_len(payload: Any, model: str) -> int | None:
    """``max_model_len`` of ``model`` in a ``/v1/models`` answer (the first entry when no id matches)."""
    chosen = model_entry(payload, model)
    value = chosen.get("max_model_len") if chosen is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class EngineBudget:
    """Per-model engine limits (cached) and exact prompt counts, through the engine client.

    Args:
        client: an :class:`~cpmemory.engines.client.AsyncEngineClient` of the engine (or gateway) asked for
            ``/v1/models`` and ``/tokenize`` (the proxy's: on its transport's connection pool).
        tokenizer: a local tokenizer of the served model (``LocalTokenizer``) that counts instead of ``/tokenize``.
    """

    def __init__(self, client: Any, tokenizer: Any = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._tokenizer = tokenizer
        self._clock = clock
        # every map below is keyed by a model the engine lists (served_model), "" while none is known: a client's
        # ``model`` string never adds an entry, whatever it is
        self._served: dict[str, int | None] = {}  # served model -> its max_model_len, from /v1/models
        self._listed_at: float | None = None  # when /v1/models last answered or failed
        self._listing: asyncio.Future[None] | None = None
        self._limits: dict[str, EngineLimits] = {}
        self._ratio: dict[str, tuple[int, float]] = {}  # model -> (prompts counted, largest engine/planned ratio)
        self._checking: dict[str, asyncio.Future[EngineLimits]] = {}  # model -> its limits being asked

    def served_model(self, model: str) -> str:
        """The model a request for ``model`` is counted under: ``model`` when the engine lists it, else the first
        model it lists (a name it does not serve is refused by vLLM, or mapped by a gateway: either way the limits
        asked are the served model's), "" before the engine has listed any. Pure; O(1)."""
        if model in self._served:
            return model
        return next(iter(self._served), "")

    async def _list_models(self, model: str | None) -> None:
        """Ask ``/v1/models`` (one call shared by concurrent callers) when it never answered, or when it failed or
        does not list ``model`` and ``RETRY_AFTER_S`` has passed since it was last asked: unknown names cost at most
        one call per ``RETRY_AFTER_S`` together. Never raises."""
        listed_at = self._listed_at
        if listed_at is not None and (model is None or model in self._served or self._clock() - listed_at
                                      < RETRY_AFTER_S):
            return
        if self._listing is None:
            self._listing = asyncio.ensure_future(self._fetch_models())

            def done(_: Any) -> None:
                self._listing = None

            self._listing.add_done_callback(done)
        await asyncio.shield(self._listing)

    async def _fetch_models(self) -> None:
        try:
            listed = await self._client.models()
        except Exception as error:  # noqa: BLE001 - an engine without /v1/models (or not up yet) gives no budget
            logger.debug("GET /v1/models failed: %s", error)
            listed = None
        self._listed_at = self._clock()
        entries = listed.get("data") if isinstance(listed, Mapping) else None
        served = {entry["id"]: model_len(listed, entry["id"]) for entry in entries if isinstance(entry, Mapping)
                  and isinstance(entry.get("id"), str) and entry["id"]} if isinstance(entries, list) else {}
        if served or listed is not None:
            self._served = served

    def should_count(self, model: str, planned: int, budget: int, upper_bound: int | None = None) -> bool:
        """Whether the engine must count a prompt planned at ``planned`` tokens (see the module docstring); never
        when ``upper_bound`` (:meth:`EngineLimits.upper_bound`) fits the budget."""
        if upper_bound is not None and upper_bound <= budget:
            return False
        counted, ratio = self._ratio.get(self.served_model(model), (0, 0.0))
        assumed = max(ratio, UNLEARNED_RATIO) if counted < LEARN_COUNTS else max(ratio, 1.0)
        return planned * assumed * COUNT_SLACK > budget

    def observe(self, model: str, planned: int, engine_tokens: int) -> None:
        """Remember the engine's count of a prompt planned at ``planned`` tokens (under :meth:`served_model`)."""
        key = self.served_model(model)
        counted, ratio = self._ratio.get(key, (0, 0.0))
        self._ratio[key] = (counted + 1, max(ratio, engine_tokens / max(1, planned)))

    def learn(self, model: str, planned: int | None, engine_tokens: int | None) -> None:
        """An answered prompt: the engine's ``usage.prompt_tokens`` of a prompt the facade planned at ``planned``
        (a count for free; prompts under ``LEARN_MIN_TOKENS`` are skipped: the chat template's own tokens weigh
        too much there)."""
        if planned and engine_tokens and planned >= LEARN_MIN_TOKENS:
            self.observe(model, planned, engine_tokens)

    def planning_budget(self, model: str, budget: int) -> int:
        """The facade's budget, in its counter's tokens, for ``budget`` engine tokens: once ``LEARN_COUNTS`` prompts
        of the model were counted, ``budget`` over the largest engine/planned ratio seen (times ``PLAN_MARGIN``);
        before, ``budget`` itself. The default counter is built never to under-count a common tokenizer, so planned
        against the engine's limit in its own tokens a prompt would be cut (its history windowed, which changes its
        prefix and costs the cache) well before the engine's context is full; prompts that could still exceed the
        engine's limit are counted exactly before they are sent (:meth:`should_count` keeps assuming no
        over-count)."""
        counted, ratio = self._ratio.get(self.served_model(model), (0, 0.0))
        if counted < LEARN_COUNTS or ratio <= 0:
            return budget
        return max(1, int(budget / ratio * PLAN_MARGIN))

    @property
    def client(self) -> Any:
        """The engine client asked for ``/v1/models`` and ``/tokenize``."""
        return self._client

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Count prompts with ``tokenizer`` (the engine's own, found after start) instead of ``/tokenize``."""
        self._tokenizer = tokenizer

    async def limits(self, model: str) -> EngineLimits:
        """The engine's limits for the model a request names: those of :meth:`served_model` (asked once per model
        the engine lists; again after RETRY_AFTER_S when it did not answer). Bounded: one entry per listed model.

        Concurrent callers share one check: a burst reaching a fresh proxy asked ``/v1/models`` and ``/tokenize``
        once per request (one of each per question, queued at the engine's API server behind the burst, seconds
        of each question's time). A name the engine does not list costs no call of its own
        (:meth:`_list_models`)."""
        await self._list_models(model)
        key = self.served_model(model)
        known = self._limits.get(key)
        if known is not None and (known.max_model_len is not None or self._clock() - known.checked_at
                                  < RETRY_AFTER_S):
            return known
        checking = self._checking.get(key)
        if checking is None:
            checking = self._checking[key] = asyncio.ensure_future(self._check(key))
            checking.add_done_callback(lambda _: self._checking.pop(key, None))
        return await asyncio.shield(checking)

    async def warm(self) -> None:
        """Ask the limits of every model the engine lists, once, when the proxy starts: the first requests then find
        them known. Without it a burst reaching a fresh proxy waited in ``prepare`` for the one shared check, behind
        the burst's own parsing, and that wait was counted as the proxy's overhead. Never raises: an engine that is
        not up yet is asked on the first request, as before."""
        await self._list_models(None)
        for model in list(self._served):
            if model not in self._limits:
                await self.limits(model)

    async def _check(self, model: str) -> EngineLimits:
        length = self._served.get(model)
        template = await self.count(model, [{"role": "user", "content": "ping"}]) if length is not None else None
        limits = EngineLimits(length, template is not None, self._clock(), template)
        self._limits[model] = limits
        return limits

    async def count(self, model: str, messages: Sequence[Mapping[str, str]]) -> int | None:
        """The engine's token count of a chat prompt (template applied), or None when ``/tokenize`` fails."""
        try:
            counter = self._tokenizer if self._tokenizer is not None else self._client
            return len(await counter.tokenize([dict(m) for m in messages], model=self.served_model(model) or model))
        except Exception as error:  # noqa: BLE001 - counted as "no /tokenize"
            logger.debug("POST /tokenize failed: %s", error)
            return None


def tighter_budget(budget: int, planned_tokens: int, engine_tokens: int) -> int:
    """The facade budget for a replan: the planned size scaled by budget / engine count, with a small margin."""
    scaled = int(planned_tokens * budget / max(1, engine_tokens) * REPLAN_MARGIN)
    return max(1, min(scaled, planned_tokens - 1))
