"""``cpmemory bench replay``: replay one trace through every strategy on the same simulated cache.

For every strategy the same trace is planned (:mod:`cpmemory.bench.strategies`), its prompts are built, checked with
``check_no_loss``, and run in execution order through a fresh ``PrefixCacheSimulator`` of the same capacity.

Prompts: every strategy writes the same system prompt, block format (``cpmemory.core.annotations``), order
annotation (when the prompt order differs from the relevance order) and question; multi-turn sessions carry their
history (each earlier turn's user message as sent, then its answer) as the prompt prefix. The ``cpmemory``
strategy's prompts come from the real facade (``CpMemory.prepare`` with ``prompt_order`` from ``plan_batch``, then
``commit``), which adds de-duplication and reference annotations; the others never de-duplicate.

Capacity ``N%`` is N percent of the workload's unique tokens: the tokens of its distinct content segments (blocks
as rendered, queries, answers) plus one request's frame (system prompt and chat template).
"""
from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import typer

from cpmemory.bench import bounds
from cpmemory.bench.results import ReplayReport, StrategyResult
from cpmemory.bench.strategies import PLANNERS, STRATEGIES, LongestPrefixScheduler, PlanInput, StrategyPlan
from cpmemory.bench.trace import Trace, TraceRequest
from cpmemory.core import annotations
from cpmemory.core.blocks import Block, content_hash, label_for_hash
from cpmemory.errors import CpMemoryError, InvalidInputError

_ANNOTATION_LINE = re.compile(
    r"^(?:\[D[0-9a-f]{7,32}\]" + re.escape(annotations.REFERENCE_SUFFIX) + r"|" + re.escape(annotations.ORDER_PREFIX)
    + r".*|\(Rest of \[D[0-9a-f]{7,32}\].*)$", re.MULTILINE)
_SECTION_START = re.compile(r"(?=\n\[)")
Progress = Callable[[int], None]


def _tokenizer():
    from cpmemory.bench import tokenizer

    return tokenizer


def message_tokens(text: str) -> list[int]:
    """Token ids of ``text``, equal to ``tokenize(text)``, memoised per block section.

    The text is cut before every ``"\\n["`` (a block header or labelled line starts there). The tokenizer never
    makes a piece across that point (a newline followed by ``[`` ends a whitespace piece; ``[`` starts a
    punctuation piece), so the pieces are the same, and each section (a block as rendered) is tokenized once for
    the whole replay instead of once per prompt. ``tests/unit/bench/test_replay.py`` checks the equality.
    """
    tokenize_cached = _tokenizer().tokenize_cached
    tokens: list[int] = []
    for part in _SECTION_START.split(text):
        tokens.extend(tokenize_cached(part))
    return tokens


def count_message_tokens(text: str) -> int:
    """``len(tokenize(text))`` through :func:`message_tokens`' memoised sections."""
    tokenize_cached = _tokenizer().tokenize_cached
    return sum(len(tokenize_cached(part)) for part in _SECTION_START.split(text))


def chat_tokens(messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the rendered chat prompt, equal to ``tokenizer.tokenize_chat(messages)``."""
    tok = _tokenizer()
    tokens: list[int] = []
    for message in messages:
        tokens.extend(message_tokens(f"{tok.CHAT_START}{message['role']}\n{message['content']}{tok.CHAT_END}\n"))
    tokens.extend(tok.tokenize_cached(f"{tok.CHAT_START}assistant\n"))
    return tokens


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """One request's distinct blocks (relevance order) and their content keys."""

    blocks: tuple[Block, ...]
    keys: tuple[str, ...]


def prepare_requests(trace: Trace) -> list[PreparedRequest]:
    """Blocks of each request as ``Block``s, repeated contents dropped (first kept), with their content hashes."""
    out = []
    for request in trace.requests:
        blocks: dict[str, Block] = {}
        for block in request.blocks:
            blocks.setdefault(content_hash(block.text), Block(block.id, block.text))
        out.append(PreparedRequest(tuple(blocks.values()), tuple(blocks)))
    return out


def answer_of(request: TraceRequest) -> str:
    """The assistant answer kept in the history (the trace's, else a deterministic stand-in)."""
    return request.answer if request.answer is not None else f"(answer to turn {request.turn})"


def annotation_tokens(text: str) -> int:
    """Tokens of the annotation lines (references, order, partial trailers) in a user message."""
    count = _tokenizer().count_tokens
    return sum(count(match.group()) for match in _ANNOTATION_LINE.finditer(text))


def plain_user_message(blocks: Sequence[Block], order: Sequence[int], query: str) -> str:
    """The user message with every block in full in ``order`` (order annotation when it differs from relevance)."""
    labels = [block.label for block in blocks]
    sections = [annotations.format_block(labels[i], blocks[i].text) for i in order]
    appearance = [labels[i] for i in order]
    return annotations.build_user_message(
        sections, [], labels if appearance != labels else None, query, appearance
    )


# ---------------------------------------------------------------- prompt builders

class PlainPromptBuilder:
    """Prompts without de-duplication (every baseline). Keeps each session's history (as sent, then the answer)."""

    def __init__(self, system_prompt: str, multi_turn: bool) -> None:
        """Create a builder; ``multi_turn`` keeps history per session."""
        self.system_prompt = system_prompt
        self.multi_turn = multi_turn
        self._history: dict[str, list[dict[str, str]]] = defaultdict(list)

    def build(self, request: TraceRequest, prepared: PreparedRequest, context: Sequence[str]) -> dict[str, Any]:
        """Return ``{"messages", "dedup_saved", "annotation"}`` for ``request`` with blocks in ``context`` order."""
        position = {key: i for i, key in enumerate(prepared.keys)}
        user = plain_user_message(prepared.blocks, [position[key] for key in context], request.query)
        history = self._history[request.session] if self.multi_turn else []
        messages = [{"role": "system", "content": self.system_prompt}, *history, {"role": "user", "content": user}]
        if self.multi_turn:
            history.extend([{"role": "user", "content": user}, {"role": "assistant", "content": answer_of(request)}])
        return {"messages": messages, "dedup_saved": 0, "annotation": annotation_tokens(user)}


class FacadePromptBuilder:
    """Prompts from the product: ``CpMemory.prepare(prompt_order=...)`` then ``commit`` (dedup + annotations)."""

    def __init__(self, system_prompt: str, multi_turn: bool, store: Any = None) -> None:
        """Create a fresh ``CpMemory`` (in memory, or on ``store``)."""
        from cpmemory.facade import CpMemory
        from cpmemory.session.config import CpMemoryConfig

        self.memory = CpMemory(store=store, config=CpMemoryConfig(system_prompt=system_prompt, ttl_s=None))
        self.multi_turn = multi_turn
        self._count = 0
        self.middleware_ms = 0.0

    def build(self, request: TraceRequest, prepared: PreparedRequest, context: Sequence[str]) -> dict[str, Any]:
        """Prepare and commit the turn; return its messages, the content tokens dedup removed, annotation tokens."""
        position = {key: i for i, key in enumerate(prepared.keys)}
        order = [position[key] for key in context]
        conversation = request.session if self.multi_turn else f"{request.session}#{self._count}"
        self._count += 1
        turn = self.memory.prepare(conversation, request.query, prepared.blocks,
                                   prompt_order=[prepared.blocks[i].id for i in order])
        self.memory.commit(turn, answer_of(request))
        user = turn.messages[-1]["content"]
        count = count_message_tokens
        plain = plain_user_message(prepared.blocks, order, request.query)
        added = annotation_tokens(user)
        saved = (count(plain) - annotation_tokens(plain)) - (count(user) - added)
        return {"messages": turn.messages, "dedup_saved": max(0, saved), "annotation": added}


    def build_online(self, request: TraceRequest, prepared: PreparedRequest) -> dict[str, Any]:
        """Like :meth:`build` with no ``prompt_order``: the facade's online ordering decides (the integrations' path).

        ``middleware_ms`` is then the time of ``prepare`` + ``commit`` alone (not this benchmark's token counting).
        """
        conversation = request.session if self.multi_turn else f"{request.session}#{self._count}"
        self._count += 1
        started = time.perf_counter()
        turn = self.memory.prepare(conversation, request.query, prepared.blocks)
        self.memory.commit(turn, answer_of(request))
        self.middleware_ms = (time.perf_counter() - started) * 1000.0
        user = turn.messages[-1]["content"]
        position = {block.id: i for i, block in enumerate(prepared.blocks)}
        order = [position[block_id] for block_id in turn.prompt_order]
        order += [i for i in range(len(prepared.blocks)) if i not in set(order)]
        plain = plain_user_message(prepared.blocks, order, request.query)
        added = annotation_tokens(user)
        saved = (count_message_tokens(plain) - annotation_tokens(plain)) - (count_message_tokens(user) - added)
        return {"messages": turn.messages, "dedup_saved": max(0, saved), "annotation": added}


# ---------------------------------------------------------------- the replay

@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """How to replay: capacity (tokens, or ``"N%"`` of unique tokens), cache model, strategies, prompt keeping."""

    capacity: str | int = "20%"
    mode: str = "radix"
    page_size: int | None = None
    strategies: tuple[str, ...] = STRATEGIES
    keep_prompts: bool = False
    system_prompt: str | None = None


def system_prompt_for(settings: ReplaySettings) -> str:
    if settings.system_prompt is not None:
        return settings.system_prompt
    from cpmemory.session.config import DEFAULT_SYSTEM_PROMPT

    return DEFAULT_SYSTEM_PROMPT


def original_contents(trace: Trace, prepared: Sequence[PreparedRequest], system_prompt: str,
                      ) -> tuple[list[bounds.RequestContent], list[list[dict[str, str]]]]:
    """Prompts of the original strategy and their content segments (for the bounds and the capacity)."""
    tok = _tokenizer()
    builder = PlainPromptBuilder(system_prompt, trace.multi_turn)
    history: dict[str, list[bounds.Segment]] = defaultdict(list)
    contents, prompts = [], []
    for request, item in zip(trace.requests, prepared):
        messages = builder.build(request, item, item.keys)["messages"]
        own = [bounds.Segment(("block", key), tok.tokenize_cached(annotations.format_block(block.label, block.text)))
               for key, block in zip(item.keys, item.blocks)]
        own.append(bounds.Segment(("query", request.query), tok.tokenize_cached(annotations.format_question(request.query))))
        segments = tuple(history[request.session]) + tuple(own)
        contents.append(bounds.RequestContent(segments, len(chat_tokens(messages))))
        prompts.append(messages)
        if trace.multi_turn:
            answer = answer_of(request)
            history[request.session].extend([*own, bounds.Segment(("answer", answer), tok.tokenize_cached(answer))])
    return contents, prompts


def unique_tokens(contents: Sequence[bounds.RequestContent]) -> int:
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
            value = float(text[:-1])
            if value < 0:
                raise ValueError(text)
            return round(unique * value / 100.0)
        value = int(text)
        if value < 0:
            raise ValueError(text)
        return value
    except ValueError as exc:
        raise InvalidInputError(f"--capacity must be a token count or a percentage like 20%, got {capacity!r}") from exc


def _plan_input(trace: Trace, prepared: Sequence[PreparedRequest]) -> PlanInput:
    count = _tokenizer().count_tokens
    tokens: dict[str, int] = {}
    for item in prepared:
        for key, block in zip(item.keys, item.blocks):
            tokens.setdefault(key, count(annotations.format_block(block.label, block.text)))
    return PlanInput([list(item.keys) for item in prepared], trace.sessions, tokens, trace.multi_turn)


def _lpm_order(trace: Trace, prompts: Sequence[list[dict[str, str]]], capacity: int) -> list[int]:
    count = _tokenizer().count_tokens
    segments = []
    for messages in prompts:
        row = []
        for message in messages:
            parts = message["content"].split(annotations.SECTION_SEPARATOR)
            row.extend((hash((message["role"], part)), count(part)) for part in parts)
        segments.append(row)
    return LongestPrefixScheduler(capacity).order(segments, trace.sessions, trace.multi_turn)


def run_strategy(name: str, plan: StrategyPlan, trace: Trace, prepared: Sequence[PreparedRequest],
                 settings: ReplaySettings, capacity: int, progress: Progress | None = None) -> StrategyResult:
    """Build the prompts of one strategy, check them, and run them through a fresh simulator."""
    from cpmemory.bench.simulator import PrefixCacheSimulator
    from cpmemory.core.invariants import check_no_loss

    system_prompt = system_prompt_for(settings)
    builder_type = FacadePromptBuilder if name == "cpmemory" else PlainPromptBuilder
    builder = builder_type(system_prompt, trace.multi_turn)
    order = plan.order
    if order is None:  # online scheduling: prompts do not depend on the order for the plain builder
        built = [PlainPromptBuilder(system_prompt, trace.multi_turn).build(r, p, c)["messages"]
                 for r, p, c in zip(trace.requests, prepared, plan.contexts)]
        order = _lpm_order(trace, built, capacity)
    amortized_ms = plan.planning_seconds * 1000.0 / max(1, len(order))
    simulator = PrefixCacheSimulator(capacity, mode=settings.mode, page_size=settings.page_size)
    result = StrategyResult(name, prompts=[] if settings.keep_prompts else None,
                            planning_seconds=plan.planning_seconds)
    for index in order:
        request, item = trace.requests[index], prepared[index]
        started = time.perf_counter()
        built = builder.build(request, item, plan.contexts[index])
        result.overhead_ms.append((time.perf_counter() - started) * 1000.0 + amortized_ms)
        report = check_no_loss(list(item.blocks), built["messages"])
        result.violations.extend(f"request {index}: {v}" for v in report.violations)
        tokens = chat_tokens(built["messages"])
        cached = simulator.run(tokens)
        result.record(built, len(tokens), cached, index)
        if result.prompts is not None:
            result.prompts.append(built["messages"])
        if progress is not None:
            progress(1)
    return result


def run_replay(trace: Trace, settings: ReplaySettings = ReplaySettings(),
               progress: Progress | None = None, online_window: int | None = None,
               online_workers: int | None = None, redis_url: str | None = None,
               fleet: Any = None) -> ReplayReport:
    """Replay ``trace`` through every strategy of ``settings`` on the same cache. Deterministic apart from timings.

    A strategy whose optional dependency is missing is reported under ``unavailable``. With ``online_window``,
    the online strategies (:mod:`cpmemory.bench.online`) run too, on the same capacity (``report.online``); the
    offline ``original`` and ``cpmemory`` then always run (the gain share needs them).
    """
    if online_window is not None:
        from cpmemory.bench.online import check_window

        check_window(online_window)
        missing = tuple(name for name in ("original", "cpmemory") if name not in settings.strategies)
        settings = replace(settings, strategies=tuple(settings.strategies) + missing)
    from cpmemory.bench.tokenizer import count_tokens

    unknown = set(settings.strategies) - set(STRATEGIES)
    if unknown:
        raise InvalidInputError(f"unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    prepared = prepare_requests(trace)
    contents, _prompts = original_contents(trace, prepared, system_prompt_for(settings))
    unique = unique_tokens(contents)
    capacity = resolve_capacity(settings.capacity, unique)
    batch = _plan_input(trace, prepared)
    results: dict[str, StrategyResult] = {}
    unavailable: dict[str, str] = {}
    for name in settings.strategies:
        try:
            plan = PLANNERS[name](batch)
        except ImportError as exc:  # includes MissingDependencyError
            unavailable[name] = f"not installed: {exc}"
            if progress is not None:
                progress(len(trace.requests))
            continue
        results[name] = run_strategy(name, plan, trace, prepared, settings, capacity, progress)
    online = None
    if online_window is not None:
        from cpmemory.bench.online import run_online

        online = run_online(trace, prepared, system_prompt_for(settings), capacity, settings.mode, settings.page_size,
                            online_window, results, progress=progress, workers=online_workers,
                            redis_url=redis_url, fleet=fleet)
    return ReplayReport(
        online=online,
        workload=trace.name, requests=len(trace.requests), capacity_tokens=capacity, unique_tokens=unique,
        mode=settings.mode, multi_turn=trace.multi_turn, results=results, unavailable=unavailable,
        oracle_hit_rate=bounds.oracle_hit_rate(contents), mst_bound_hit_rate=bounds.mst_bound_hit_rate(contents),
        dedup_bound_tokens=bounds.dedup_bound_tokens(trace, lambda text: count_tokens(
            annotations.format_block(label_for_hash(content_hash(text)), text))),
        skipped_lines=[str(error) for error in trace.skipped],
    )


def replay_on_engine(report: ReplayReport, url: str, *, model: str = "tiny", transport: Any = None) -> None:
    """Send every strategy's prompts (execution order) to a real engine; keep its TTFT and cached tokens.

    Uses ENGINES' ``cpmemory.bench.replay_real.measure`` (cache reset before each strategy). Mutates ``report``.
    """
    from cpmemory.bench.replay_real import measure

    for result in report.results.values():
        if result.prompts:
            result.real = dict(measure(result.prompts, url, model=model, transport=transport))


# ---------------------------------------------------------------- command

def _load_trace(trace_file: Path | None, workload: str | None, data_dir: Path | None, skip_bad: bool,
                multi_turn: bool | None) -> Trace:
    from cpmemory.bench.loaders import load_workload
    from cpmemory.bench.trace import read_trace

    if (trace_file is None) == (workload is None):
        raise InvalidInputError("give exactly one of --trace FILE or --workload NAME")
    if trace_file is not None:
        return read_trace(trace_file, skip_bad=skip_bad, multi_turn=multi_turn)
    return load_workload(workload, data_dir)  # type: ignore[arg-type]


def _fleet(replicas: int | None, router: str, online: bool) -> Any:
    """``FleetSettings`` for ``--replicas N --router R`` (None without ``--replicas``). Raises InvalidInputError."""
    if replicas is None:
        return None
    if not online:
        raise InvalidInputError("--replicas needs --online (the offline strategies run on one cache)")
    from cpmemory.bench.replicas import FleetSettings

    return FleetSettings(replicas=replicas, router=router)  # type: ignore[arg-type]


def command(
    trace_file: Path | None = typer.Option(None, "--trace", help="A JSON Lines trace (see docs)."),
    workload: str | None = typer.Option(None, "--workload", help="locomo | mt_rag | multihop | synthetic"),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Data folder (default ../shared/data)."),
    engine: str = typer.Option("sim", "--engine", help="'sim' (built-in simulator) or a vLLM base URL."),
    capacity: str = typer.Option("20%", "--capacity", help="Cache size: tokens, or N% of unique tokens."),
    mode: str = typer.Option("radix", "--mode", help="Simulated cache: radix (SGLang) or vllm."),
    page_size: int | None = typer.Option(None, "--page-size", help="Radix page / vLLM block size in tokens."),
    strategies: str | None = typer.Option(None, "--strategies", help="Comma-separated subset of strategies."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG plot of hit rate and cached tokens."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip malformed trace lines instead of stopping."),
    multi_turn: bool | None = typer.Option(None, "--multi-turn/--independent", help="Override the trace's flag."),
    model: str = typer.Option("tiny", "--model", help="Served model name (with --engine URL)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    online: bool = typer.Option(False, "--online", help="Also replay the online strategies (requests as they arrive)."),
    window: int = typer.Option(1, "--window", help="Online: how many waiting requests are ordered together (>= 1)."),
    workers: int | None = typer.Option(None, "--workers", help="Online: K facades on one Redis, round robin."),
    replicas: int | None = typer.Option(None, "--replicas", help="Online: N simulated replicas of capacity/N each."),
    router: str = typer.Option("prefix", "--router", help="Online with --replicas: prefix (default) or affinity."),
    redis_url: str | None = typer.Option(None, "--redis", help="With --workers: Redis URL (default: a throw-away "
                                         "local redis-server)."),
) -> None:
    """Replay a trace or a real workload through every strategy on the same cache; print a table or JSON."""
    from rich.markup import escape

    from cpmemory.bench import report as report_module

    err = report_module.stderr_console()
    try:
        trace = _load_trace(trace_file, workload, data_dir, skip_bad, multi_turn)
        names = tuple(s.strip() for s in strategies.split(",")) if strategies else STRATEGIES
        if online:
            from cpmemory.bench.online import ONLINE_STRATEGIES, check_window

            check_window(window)
            names += tuple(name for name in ("original", "cpmemory") if name not in names)
        settings = ReplaySettings(capacity=capacity, mode=mode, page_size=page_size, strategies=names,
                                  keep_prompts=engine != "sim")
        for error in trace.skipped:
            err.print(f"[yellow]skipped[/] {escape(str(error))}", soft_wrap=True)
        total = len(trace.requests) * (len(names) + (len(ONLINE_STRATEGIES) if online else 0))
        with report_module.progress_bar(total, f"replay {trace.name}") as advance:
            result = run_replay(trace, settings, advance, online_window=window if online else None,
                                online_workers=workers, redis_url=redis_url,
                                fleet=_fleet(replicas, router, online))
        if engine != "sim":
            replay_on_engine(result, engine, model=model)
    except (CpMemoryError, ImportError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(code=2) from exc
    if plot is not None:
        report_module.plot_replay(result, plot)
        if result.online is not None:
            report_module.plot_online(result, plot.with_name(f"{plot.stem}-online{plot.suffix}"))
    if json_output:
        sys.stdout.write(report_module.json_line(result.to_json()) + "\n")
    else:
        report_module.print_replay(result)
