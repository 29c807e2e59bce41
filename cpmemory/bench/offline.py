"""Replay a whole trace, planned in advance, on the built-in prefix-cache simulator (``cpmemory demo``'s offline run).

A *planner* sees the whole batch (:class:`PlanInput`) and returns a :class:`StrategyPlan`: the execution order and
each request's block order. :func:`replay_offline` builds every strategy's prompts (:mod:`cpmemory.bench.prompts`;
the ``cpmemory`` strategy through the facade), checks them with ``check_no_loss`` and runs them in execution order
through a fresh ``PrefixCacheSimulator`` of the same capacity. The package's planners are ``original`` (retrieval
order, first come first served) and ``cpmemory`` (``plan_batch``); the research replay in ``benchmarks/`` passes
its baselines and adds the bounds and the online strategies.

Capacity ``N%`` is N percent of the workload's unique tokens: the tokens of its distinct content segments (blocks
as rendered, queries, answers) plus one request's frame (system prompt and chat template).
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cpmemory.bench import tokenizer
from cpmemory.bench.prompts import (
    FacadePromptBuilder,
    PlainPromptBuilder,
    PreparedRequest,
    answer_of,
    chat_tokens,
    prepare_requests,
)
from cpmemory.bench.results import ReplayReport, StrategyResult
from cpmemory.bench.simulator import PrefixCacheSimulator, SimulatorMode
from cpmemory.bench.trace import Trace
from cpmemory.core import annotations as prompt_format
from cpmemory.errors import InvalidInputError

Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class StrategyPlan:
    """What a strategy decided before the replay.

    Attributes:
        order: execution order (indices into the trace's requests); None means decided online (the research
            replay's longest-prefix-match scheduler resolves it before :func:`run_strategy`).
        contexts: each request's block keys in prompt order (a permutation of its input).
        planning_seconds: wall time the planner took for the whole batch.
    """

    order: list[int] | None
    contexts: list[list[str]]
    planning_seconds: float


@dataclass(frozen=True, slots=True)
class PlanInput:
    """The batch every planner sees: block keys per request, session per request, tokens per block key."""

    contexts: list[list[str]]
    sessions: list[str]
    token_counts: dict[str, int]
    multi_turn: bool


Planner = Callable[[PlanInput], StrategyPlan]


def keep_turn_order(order: Sequence[int], sessions: Sequence[str]) -> list[int]:
    """Return ``order`` with each session's requests put back in trace order, keeping the interleaving pattern.

    The k-th time a session appears in ``order`` it runs that session's k-th request. Pure, O(n).

    Raises:
        InvalidInputError: ``order`` is not a permutation of ``range(len(sessions))``.
    """
    if sorted(order) != list(range(len(sessions))):
        raise InvalidInputError("an execution order must be a permutation of the requests")
    queues: dict[str, list[int]] = defaultdict(list)
    for index, session in enumerate(sessions):
        queues[session].append(index)
    cursor: Counter[str] = Counter()
    out = []
    for index in order:
        session = sessions[index]
        out.append(queues[session][cursor[session]])
        cursor[session] += 1
    return out


def checked_contexts(contexts: Sequence[Sequence[str]], planned: Sequence[Sequence[Hashable]],
                     name: str) -> list[list[str]]:
    """``planned`` as block keys, each context checked to be a permutation of its input.

    Raises:
        InvalidInputError: a planner returned another number of contexts, or other blocks.
    """
    if len(planned) != len(contexts):
        raise InvalidInputError(f"{name}: returned {len(planned)} contexts for {len(contexts)} requests")
    out = []
    for index, (before, after) in enumerate(zip(contexts, planned)):
        if Counter(before) != Counter(after):
            raise InvalidInputError(f"{name}: request {index}'s blocks are not a permutation of its input")
        key_of: dict[Hashable, str] = {key: key for key in before}
        out.append([key_of[key] for key in after])
    return out


def plan_original(batch: PlanInput) -> StrategyPlan:
    """Retrieval order, FCFS."""
    return StrategyPlan(list(range(len(batch.contexts))), [list(c) for c in batch.contexts], 0.0)


def plan_cpmemory(batch: PlanInput) -> StrategyPlan:
    """``plan_batch`` (order and schedule; sessions keep their turn order)."""
    from cpmemory.core.planner import plan_batch

    started = time.perf_counter()
    token_counts: dict[Hashable, float] = dict(batch.token_counts.items())
    result = plan_batch([list(c) for c in batch.contexts], sessions=list(batch.sessions), token_counts=token_counts)
    seconds = time.perf_counter() - started
    contexts = checked_contexts(batch.contexts, result.contexts, "cpmemory")
    return StrategyPlan(keep_turn_order(list(result.order), batch.sessions), contexts, seconds)


PRODUCT_PLANNERS: dict[str, Planner] = {"original": plan_original, "cpmemory": plan_cpmemory}


@dataclass(frozen=True, slots=True)
class Segment:
    """One content segment of a prompt: ``key`` identifies the content, ``tokens`` its token ids."""

    key: Hashable
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestContent:
    """The content of one request's prompt (for the capacity and the research replay's bounds).

    Attributes:
        segments: content segments (blocks, history turns, query), any order.
        prompt_tokens: tokens of the whole prompt.
    """

    segments: tuple[Segment, ...]
    prompt_tokens: int

    @property
    def frame_tokens(self) -> int:
        """Prompt tokens not covered by a content segment (system prompt, template, headers)."""
        return max(0, self.prompt_tokens - sum(len(segment.tokens) for segment in self.segments))


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """How to replay: capacity (tokens, or ``"N%"`` of unique tokens), cache model, strategies, prompt keeping."""

    capacity: str | int = "20%"
    mode: SimulatorMode = "radix"
    page_size: int | None = None
    strategies: tuple[str, ...] = tuple(PRODUCT_PLANNERS)
    keep_prompts: bool = False
    system_prompt: str | None = None


def system_prompt_for(settings: ReplaySettings) -> str:
    """The settings' system prompt, else the product's default."""
    if settings.system_prompt is not None:
        return settings.system_prompt
    from cpmemory.session.config import DEFAULT_SYSTEM_PROMPT

    return DEFAULT_SYSTEM_PROMPT


def original_contents(trace: Trace, prepared: Sequence[PreparedRequest], system_prompt: str,
                      ) -> tuple[list[RequestContent], list[list[dict[str, str]]]]:
    """Prompts of the original strategy and their content segments (for the capacity and the bounds)."""
    builder = PlainPromptBuilder(system_prompt, trace.multi_turn)
    history: dict[str, list[Segment]] = defaultdict(list)
    contents, prompts = [], []
    for request, item in zip(trace.requests, prepared):
        messages = builder.build(request, item, item.keys)["messages"]
        own = [Segment(("block", key), tokenizer.tokenize_cached(prompt_format.format_block(block.label, block.text)))
               for key, block in zip(item.keys, item.blocks)]
        own.append(Segment(("query", request.query),
                           tokenizer.tokenize_cached(prompt_format.format_question(request.query))))
        segments = tuple(history[request.session]) + tuple(own)
        contents.append(RequestContent(segments, len(chat_tokens(messages))))
        prompts.append(messages)
        if trace.multi_turn:
            answer = answer_of(request)
            history[request.session].extend([*own, Segment(("answer", answer), tokenizer.tokenize_cached(answer))])
    return contents, prompts


def unique_tokens(contents: Sequence[RequestContent]) -> int:
    """Tokens of the distinct content segments plus the largest frame (what a cache needs to hold everything once)."""
    distinct: dict[Any, int] = {}
    for content in contents:
        for segment in content.segments:
            distinct.setdefault(segment.key, len(segment.tokens))
    return sum(distinct.values()) + max((content.frame_tokens for content in contents), default=0)


def resolve_capacity(capacity: str | int, unique: int) -> int:
    """Turn ``"N%"`` (of ``unique`` tokens) or a token count into tokens.

    Raises:
        InvalidInputError: not a non-negative integer or percentage.
    """
    text = str(capacity).strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if share < 0:
                raise ValueError(text)
            return round(unique * share / 100.0)
        tokens = int(text)
        if tokens < 0:
            raise ValueError(text)
        return tokens
    except ValueError as exc:
        raise InvalidInputError(f"--capacity must be a token count or a percentage like 20%, got {capacity!r}") from exc


def plan_input(trace: Trace, prepared: Sequence[PreparedRequest]) -> PlanInput:
    """The batch the planners see (block keys, sessions, tokens per block as rendered)."""
    tokens: dict[str, int] = {}
    for item in prepared:
        for key, block in zip(item.keys, item.blocks):
            tokens.setdefault(key, tokenizer.count_tokens(prompt_format.format_block(block.label, block.text)))
    return PlanInput([list(item.keys) for item in prepared], trace.sessions, tokens, trace.multi_turn)


def run_strategy(name: str, plan: StrategyPlan, trace: Trace, prepared: Sequence[PreparedRequest],
                 settings: ReplaySettings, capacity: int, progress: Progress | None = None) -> StrategyResult:
    """Build the prompts of one strategy, check them, and run them through a fresh simulator.

    Raises:
        InvalidInputError: the plan has no execution order.
    """
    from cpmemory.core.invariants import check_no_loss

    if plan.order is None:
        raise InvalidInputError(f"{name}: an offline replay needs an execution order")
    system_prompt = system_prompt_for(settings)
    builder: PlainPromptBuilder | FacadePromptBuilder = (
        FacadePromptBuilder(system_prompt, trace.multi_turn) if name == "cpmemory"
        else PlainPromptBuilder(system_prompt, trace.multi_turn))
    amortized_ms = plan.planning_seconds * 1000.0 / max(1, len(plan.order))
    simulator = PrefixCacheSimulator(capacity, mode=settings.mode, page_size=settings.page_size)
    result = StrategyResult(name, prompts=[] if settings.keep_prompts else None,
                            planning_seconds=plan.planning_seconds)
    for index in plan.order:
        request, item = trace.requests[index], prepared[index]
        started = time.perf_counter()
        built = builder.build(request, item, plan.contexts[index])
        result.overhead_ms.append((time.perf_counter() - started) * 1000.0 + amortized_ms)
        report = check_no_loss(list(item.blocks), built["messages"])
        result.violations.extend(f"request {index}: {v}" for v in report.violations)
        tokens = chat_tokens(built["messages"])
        result.record(built, len(tokens), simulator.run(tokens), index)
        if result.prompts is not None:
            result.prompts.append(built["messages"])
        if progress is not None:
            progress(1)
    return result


def replay_offline(trace: Trace, settings: ReplaySettings = ReplaySettings(),
                   planners: Mapping[str, Planner] = PRODUCT_PLANNERS, progress: Progress | None = None,
                   resolve_order: Callable[[str, StrategyPlan, int], StrategyPlan] | None = None) -> ReplayReport:
    """Replay ``trace`` through every strategy of ``settings`` on the same cache. Deterministic apart from timings.

    ``resolve_order(name, plan, capacity)`` may fill in a plan's execution order before it runs. A strategy whose
    optional dependency is missing is reported under ``unavailable``; the bounds are left for the caller.

    Raises:
        InvalidInputError: a strategy not in ``planners``, or a bad capacity.
    """
    unknown = set(settings.strategies) - set(planners)
    if unknown:
        raise InvalidInputError(f"unknown strategies {sorted(unknown)}; choose from {', '.join(planners)}")
    prepared = prepare_requests(trace)
    contents, _prompts = original_contents(trace, prepared, system_prompt_for(settings))
    unique = unique_tokens(contents)
    capacity = resolve_capacity(settings.capacity, unique)
    batch = plan_input(trace, prepared)
    results: dict[str, StrategyResult] = {}
    unavailable: dict[str, str] = {}
    for name in settings.strategies:
        try:
            plan = planners[name](batch)
        except ImportError as exc:  # includes MissingDependencyError
            unavailable[name] = f"not installed: {exc}"
            if progress is not None:
                progress(len(trace.requests))
            continue
        if resolve_order is not None:
            plan = resolve_order(name, plan, capacity)
        results[name] = run_strategy(name, plan, trace, prepared, settings, capacity, progress)
    return ReplayReport(
        workload=trace.name, requests=len(trace.requests), capacity_tokens=capacity, unique_tokens=unique,
        mode=settings.mode, multi_turn=trace.multi_turn, results=results, unavailable=unavailable,
        skipped_lines=[str(error) for error in trace.skipped],
    )
