"""``cpmemory bench core``: index build, search, reorder and dedup speed and memory on a seeded workload.

The workload (:func:`make_workload`) draws each context's blocks from a shared corpus of ``corpus_factor * N``
blocks with Zipf popularity (exponent ``zipf_a``, truncated to the corpus), in retrieval order, and makes a fraction
of the contexts near-duplicates of earlier ones (a few blocks replaced, two swapped), as repeated or rephrased
questions produce. Queries for the online figures come from the same process with another seed stream.

Figures: ``build_seconds`` (batch build of N contexts, wall clock; ``build_cpu_seconds`` is the CPU time of the
same build, a steadier figure on a shared machine), ``search_p50_ms`` / ``search_p99_ms`` (one search with N
contexts indexed), ``reorder_p50_ms`` (reordering by the found prefix), ``insert_p50_ms``, ``dedup_p50_ms`` (the
session stream's pure ``cpmemory.core.dedup.decide`` for one turn of a multi-turn conversation, or a seen-set
dedup when that module is absent) and ``peak_rss_mb`` (the process's peak resident memory).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import typer

from cpmemory.core.index import ContextIndex
from cpmemory.core.ordering import reorder

QUERY_COUNT = 2000
TURNS_PER_CONVERSATION = 5


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Shape of the seeded workload."""

    contexts: int
    k: int
    seed: int = 0
    corpus_factor: int = 5
    zipf_a: float = 1.1
    near_duplicate_fraction: float = 0.2


def make_workload(spec: WorkloadSpec, count: int | None = None, stream: int = 0) -> list[list[str]]:
    """Return ``count`` (default ``spec.contexts``) contexts of ``spec.k`` distinct block keys. Deterministic."""
    count = spec.contexts if count is None else count
    corpus = max(spec.corpus_factor * spec.contexts, 2 * spec.k)
    weights = np.arange(1, corpus + 1, dtype=np.float64) ** -spec.zipf_a
    cumulative = np.cumsum(weights / weights.sum())
    block_of_rank = np.random.default_rng(spec.seed).permutation(corpus)  # one corpus per seed, for every stream
    rng = np.random.default_rng([spec.seed, stream])

    def draw(size: int) -> np.ndarray:
        ranks = np.minimum(np.searchsorted(cumulative, rng.random(size)), corpus - 1)
        return block_of_rank[ranks]

    candidates = draw(count * spec.k * 3).reshape(count, spec.k * 3).tolist()
    contexts: list[list[int]] = []
    duplicates = rng.random(count) < spec.near_duplicate_fraction
    for row in range(count):
        if duplicates[row] and contexts:
            contexts.append(_near_duplicate(contexts[int(rng.integers(len(contexts)))], rng, draw))
        else:
            keys = list(dict.fromkeys(candidates[row]))[: spec.k]
            while len(keys) < spec.k:  # rare: the popular head filled the candidates with repeats
                keys = list(dict.fromkeys(keys + draw(spec.k).tolist()))[: spec.k]
            contexts.append(keys)
    return [[f"d{block}" for block in context] for context in contexts]


def _near_duplicate(
    source: list[int], rng: np.random.Generator, draw: Callable[[int], np.ndarray]
) -> list[int]:
    context = list(source)
    for slot in rng.choice(len(context), size=min(len(context), int(rng.integers(1, 4))), replace=False):
        replacement = next((int(b) for b in draw(16) if int(b) not in context), None)
        if replacement is not None:
            context[int(slot)] = replacement
    if len(context) >= 2:
        i, j = rng.choice(len(context), size=2, replace=False)
        context[i], context[j] = context[j], context[i]
    return context


@dataclass(frozen=True, slots=True)
class CoreFigures:
    """What the bench prints (the JSON object's keys)."""

    contexts: int
    k: int
    seed: int
    build_seconds: float
    build_cpu_seconds: float
    build_exact: bool
    distinct_contexts: int
    nodes: int
    search_p50_ms: float
    search_p99_ms: float
    reorder_p50_ms: float
    insert_p50_ms: float
    dedup_p50_ms: float
    dedup_source: str
    peak_rss_mb: float
    online_order_p50_ms: float = 0.0
    online_order_p99_ms: float = 0.0


def _percentile_ms(samples_ns: Sequence[int], q: float) -> float:
    return float(np.percentile(np.asarray(samples_ns, dtype=np.float64), q) / 1e6) if samples_ns else 0.0


def _time_online(index: ContextIndex, queries: list[list[str]]) -> dict[str, list[int]]:
    """Per-call nanoseconds of search, reorder and insert (inserted queries are evicted again)."""
    clock = time.perf_counter_ns
    searches, reorders, inserts = [], [], []
    for query in queries:
        start = clock()
        found = index.search(query)
        middle = clock()
        reorder(query, found.prefix)
        searches.append(middle - start)
        reorders.append(clock() - middle)
    for position, query in enumerate(queries):
        start = clock()
        index.insert(query, ("bench", position))
        inserts.append(clock() - start)
    for position in range(len(queries)):
        index.evict(("bench", position))
    return {"search": searches, "reorder": reorders, "insert": inserts}


def _time_online_order(contexts: list[list[str]], queries: list[list[str]]) -> list[int]:
    """Per-request nanoseconds of the online order (observe, order, record) with ``contexts`` recorded first."""
    from cpmemory.core.online import OnlineOrderer

    orderer = OnlineOrderer(max_requests=len(contexts) + len(queries))
    for position, context in enumerate(contexts):
        orderer.observe(context)
        orderer.record(orderer.order(context, [1.0 + len(key) for key in context]), ("indexed", position))
    samples = []
    clock = time.perf_counter_ns
    for position, query in enumerate(queries):
        sizes = [1.0 + len(key) for key in query]
        start = clock()
        orderer.observe(query)
        orderer.record(orderer.order(query, sizes), ("bench", position))
        samples.append(clock() - start)
    return samples


def _time_dedup(queries: list[list[str]]) -> tuple[list[int], str]:
    """Per-turn nanoseconds of the dedup decision over conversations of TURNS_PER_CONVERSATION turns."""
    try:
        from cpmemory.core import dedup
        from cpmemory.core.blocks import Block
    except ImportError:  # pragma: no cover - the session stream's module is absent
        return _time_seen_set_dedup(queries), "seen-set"
    samples: list[int] = []
    seen: set[str] = set()
    for turn, query in enumerate(queries):
        if turn % TURNS_PER_CONVERSATION == 0:
            seen = set()
        blocks = [Block(key, f"text of block {key}") for key in query]
        digests = [block.content_hash for block in blocks]
        frozen = frozenset(seen)
        start = time.perf_counter_ns()
        dedup.decide(blocks, digests, dedup.CommittedHistory(frozen), seen_hashes=frozen)
        samples.append(time.perf_counter_ns() - start)
        seen.update(digests)
    return samples, "cpmemory.core.dedup.decide"


def _time_seen_set_dedup(queries: list[list[str]]) -> list[int]:
    samples: list[int] = []
    seen: set[Hashable] = set()
    for turn, query in enumerate(queries):
        if turn % TURNS_PER_CONVERSATION == 0:
            seen = set()
        start = time.perf_counter_ns()
        _decisions = [key in seen for key in query]
        seen.update(query)
        samples.append(time.perf_counter_ns() - start)
    return samples


def run_core_bench(spec: WorkloadSpec, progress: Callable[[str], None] = lambda _: None) -> CoreFigures:
    """Run every phase and return the figures. Deterministic workload; timings are wall-clock."""
    progress("workload")
    contexts = make_workload(spec)
    queries = make_workload(spec, count=min(QUERY_COUNT, max(spec.contexts, 1)), stream=1)
    progress("build")
    import scipy.cluster.hierarchy  # noqa: F401  (imported lazily by the exact build; not part of its time)

    start, cpu_start = time.perf_counter(), time.process_time()
    index = ContextIndex.build(contexts, alpha=0.001)
    build_seconds, build_cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    progress("search / reorder / insert")
    online = _time_online(index, queries)
    progress("dedup")
    dedup_samples, dedup_source = _time_dedup(queries)
    progress("online order")
    order_samples = _time_online_order(contexts, queries)
    report = index.last_build
    assert report is not None
    return CoreFigures(
        contexts=spec.contexts,
        k=spec.k,
        seed=spec.seed,
        build_seconds=round(build_seconds, 4),
        build_cpu_seconds=round(build_cpu_seconds, 4),
        build_exact=report.exact,
        distinct_contexts=report.distinct_contexts,
        nodes=report.nodes,
        search_p50_ms=round(_percentile_ms(online["search"], 50), 5),
        search_p99_ms=round(_percentile_ms(online["search"], 99), 5),
        reorder_p50_ms=round(_percentile_ms(online["reorder"], 50), 5),
        insert_p50_ms=round(_percentile_ms(online["insert"], 50), 5),
        dedup_p50_ms=round(_percentile_ms(dedup_samples, 50), 5),
        dedup_source=dedup_source,
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        online_order_p50_ms=round(_percentile_ms(order_samples, 50), 5),
        online_order_p99_ms=round(_percentile_ms(order_samples, 99), 5),
    )


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr for a while (the baseline prints; stdout must stay one JSON object)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield None
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def compare_with_contextpilot(spec: WorkloadSpec, contexts: int) -> dict[str, float]:
    """Build the authors' index (``contextpilot``, CPU) and ours on the first ``contexts`` of the workload.

    Returns both build times and their ratio; raises MissingDependencyError when the package is absent.
    """
    try:
        from contextpilot.context_index.index_construction import build_context_index
    except ImportError as error:
        from cpmemory.errors import MissingDependencyError

        raise MissingDependencyError("bench", "contextpilot==0.5.0") from error
    batch = make_workload(spec)[:contexts]
    start = time.perf_counter()
    ContextIndex.build(batch)
    ours = time.perf_counter() - start
    with _stdout_to_stderr():
        start = time.perf_counter()
        build_context_index(batch, use_gpu=False, alpha=0.001)
        theirs = time.perf_counter() - start
    return {
        "baseline_contexts": contexts,
        "baseline_contextpilot_build_seconds": round(theirs, 3),
        "baseline_cpmemory_build_seconds": round(ours, 3),
        "baseline_speedup": round(theirs / max(ours, 1e-9), 1),
    }


def _print_table(figures: CoreFigures, extra: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"cpmemory bench core: {figures.contexts} contexts of k={figures.k} (seed {figures.seed})"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    targets = {
        "build_seconds": "<= 3 (12K)",
        "search_p50_ms": "search+reorder <= 0.1",
        "dedup_p50_ms": "<= 0.05",
        "online_order_p50_ms": "<= 0.3 (100K indexed)",
        "online_order_p99_ms": "<= 2 (100K indexed)",
    }
    for name, value in {**asdict(figures), **extra}.items():
        table.add_row(name, str(value), targets.get(name, ""))
    Console().print(table)


def command(
    contexts: int = typer.Option(12000, "--contexts", min=1, help="Number of contexts in the batch build."),
    k: int = typer.Option(15, "--k", min=1, help="Blocks per context."),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    baseline: int = typer.Option(
        0, "--baseline", min=0, help="Also build the authors' contextpilot index (CPU) on this many contexts."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Index build / search / reorder / dedup speed and memory on a seeded Zipf workload."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    spec = WorkloadSpec(contexts=contexts, k=k, seed=seed)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("starting", total=None)
        figures = run_core_bench(spec, progress=lambda phase: bar.update(task, description=phase))
        extra: dict[str, float] = {}
        if baseline:
            bar.update(task, description=f"contextpilot baseline on {baseline} contexts")
            extra = compare_with_contextpilot(spec, baseline)
    if json_output:
        print(json.dumps({**asdict(figures), **extra}))
    else:
        _print_table(figures, extra)
