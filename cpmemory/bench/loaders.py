"""Workload loaders: turn the public data under ``../shared/data`` (or a synthetic generator) into a Trace.

* ``locomo``: LoCoMo's 10 conversations; each QA question is one independent request whose blocks are the top-15
  dialog turns of *its* conversation ranked by BM25 (``bm25s``), like a Mem0 memory search. Multi-session.
* ``mt_rag``: MT-RAG human, multi-turn (history kept as prompt prefix). The 20 conversations with passage text use
  their reference passages per turn; the other 90 of the 110 qrels conversations use their qrels passages, with the
  real text where the reference subset has it and a deterministic ~300-token stand-in otherwise. Conversations are
  interleaved as 32 concurrent sessions (round robin; a finished one is replaced by the next).
* ``multihop``: MultiHop-RAG's 500 queries; each distinct evidence article (by url, else title) is one block whose
  text is its title and all its evidence sentences (in first-seen order), identical wherever it is retrieved.
* ``synthetic``: seeded Zipf popularity over a shared corpus (2,000 requests x 15 blocks by default); with
  ``turns_per_session > 1`` it is multi-turn and a share of each turn's blocks repeats earlier turns' blocks.
* ``locomo_sessions``: LoCoMo with whole dialog sessions as memories (about 1,000 tokens each on the tiny model):
  each QA question is one independent request whose blocks are the top-4 sessions of its conversation by BM25.
* ``synthetic300``: the synthetic generator with every block 80 pseudo-words long (about 300 tokens on the tiny
  model's tokenizer), 15 blocks per request.

Loaders read only; they never write under the data directory.
"""
from __future__ import annotations

import csv
import hashlib
import json
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from cpmemory.bench.trace import Trace, TraceBlock, TraceRequest
from cpmemory.errors import InvalidInputError, MissingDependencyError

WORKLOADS = ("locomo", "mt_rag", "multihop", "synthetic", "locomo_sessions", "synthetic300")
LOCOMO_TOP_K = 15
LOCOMO_SESSIONS_TOP_K = 4
SYNTHETIC300_WORDS = 80
MT_RAG_CONCURRENCY = 32
STAND_IN_TOKENS = 300


class WorkloadDataError(InvalidInputError):
    """A workload's data file is missing or unreadable; the message names the expected path."""


def default_data_dir(cwd: Path | None = None) -> Path:
    """Return ``../shared/data`` relative to ``cwd`` if it exists, else ``/work/shared/data`` if it exists.

    Falls back to the relative path (so the error names it) when neither exists.
    """
    relative = (cwd or Path.cwd()) / ".." / "shared" / "data"
    for candidate in (relative, Path("/work/shared/data")):
        if candidate.is_dir():
            return candidate.resolve()
    return relative


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise WorkloadDataError(f"workload data not found: expected {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkloadDataError(f"cannot read {path}: {exc}") from exc


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """Pseudo-words of one to three syllables (4,368 of them), built once."""
    syllables = ("ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "ni", "que", "ra", "tis", "pa", "mon", "e", "u")
    words = list(syllables)
    words += [a + b for a in syllables for b in syllables]
    words += [a + b + c for a in syllables for b in syllables for c in syllables]
    return tuple(words)


def _pseudo_text(seed_text: str, words: int) -> str:
    """Deterministic pseudo-English filler of ``words`` words (about one token each), seeded by ``seed_text``."""
    seed = int.from_bytes(hashlib.blake2b(seed_text.encode(), digest_size=8).digest(), "little")
    return " ".join(random.Random(seed).choices(_vocabulary(), k=words))


# ---------------------------------------------------------------- LoCoMo

def locomo_turns(sample: dict[str, Any], *, dated: bool = False) -> list[TraceBlock]:
    """A LoCoMo sample's dialog turns as blocks, once each, in session order; ``dated`` prefixes each with its
    session's date (how a memory store shows them to a model)."""
    conversation = sample["conversation"]
    blocks: list[TraceBlock] = []
    seen: set[str] = set()
    session_keys = sorted((key for key in conversation if key.startswith("session_") and not key.endswith("date_time")
                           and isinstance(conversation[key], list)), key=lambda key: int(key.split("_")[1]))
    for key in session_keys:
        date = f"({conversation.get(key + '_date_time', 'undated')}) " if dated else ""
        for turn in conversation[key]:
            block_id = f"{sample['sample_id']}:{turn['dia_id']}"
            if block_id in seen:
                continue
            seen.add(block_id)
            text = f"{date}{turn['speaker']}: {turn['text']}"
            if turn.get("blip_caption"):
                text += f" [shares an image: {turn['blip_caption']}]"
            blocks.append(TraceBlock(block_id, text))
    return blocks


def _bm25_top_k(corpus: Sequence[str], queries: Sequence[str], k: int) -> np.ndarray:
    try:
        import bm25s
    except ImportError as exc:
        raise MissingDependencyError("bench", "bm25s") from exc
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(list(corpus), stopwords="en", show_progress=False), show_progress=False)
    query_tokens = bm25s.tokenize(list(queries), stopwords="en", show_progress=False)
    results, _scores = retriever.retrieve(query_tokens, k=min(k, len(corpus)), show_progress=False, n_threads=1)
    return np.asarray(results)


def load_locomo(data_dir: Path, *, limit_conversations: int | None = None) -> Trace:
    """Load LoCoMo: one independent request per QA question, top-15 BM25 dialog turns as blocks."""
    samples = _read_json(Path(data_dir) / "locomo" / "locomo10.json")
    requests: list[TraceRequest] = []
    for sample in samples[:limit_conversations]:
        turns = locomo_turns(sample)
        questions = [str(qa["question"]) for qa in sample["qa"]]
        ranked = _bm25_top_k([block.text for block in turns], questions, LOCOMO_TOP_K)
        for index, question in enumerate(questions):
            blocks = tuple(turns[int(position)] for position in ranked[index])
            requests.append(TraceRequest(f"{sample['sample_id']}:q{index}", 0, question, blocks))
    return Trace("locomo", tuple(requests), multi_turn=False)


def _locomo_sessions(sample: dict[str, Any]) -> list[TraceBlock]:
    conversation = sample["conversation"]
    numbers = sorted(int(key.split("_")[1]) for key in conversation
                     if key.startswith("session_") and not key.endswith("date_time"))
    blocks = []
    for number in numbers:
        lines = [f"Session {number} ({conversation.get(f'session_{number}_date_time', 'undated')})"]
        for turn in conversation[f"session_{number}"]:
            text = f"{turn['speaker']}: {turn['text']}"
            if turn.get("blip_caption"):
                text += f" [shares an image: {turn['blip_caption']}]"
            lines.append(text)
        blocks.append(TraceBlock(f"{sample['sample_id']}:session_{number}", "\n".join(lines)))
    return blocks


def load_locomo_sessions(data_dir: Path, *, top_k: int = LOCOMO_SESSIONS_TOP_K) -> Trace:
    """Load LoCoMo with whole dialog sessions as memories: one independent request per QA question, its blocks the
    top-``top_k`` sessions of its own conversation by BM25 (conversations one after the other, questions in order)."""
    samples = _read_json(Path(data_dir) / "locomo" / "locomo10.json")
    requests: list[TraceRequest] = []
    for sample in samples:
        sessions = _locomo_sessions(sample)
        questions = [str(qa["question"]) for qa in sample["qa"]]
        ranked = _bm25_top_k([block.text for block in sessions], questions, top_k)
        for index, question in enumerate(questions):
            blocks = tuple(sessions[int(position)] for position in ranked[index])
            requests.append(TraceRequest(f"{sample['sample_id']}:q{index}", 0, question, blocks))
    return Trace("locomo_sessions", tuple(requests), multi_turn=False)


# ---------------------------------------------------------------- MultiHop-RAG

def load_multihop(data_dir: Path) -> Trace:
    """Load MultiHop-RAG's 500 queries; one block per distinct evidence article (see module docstring)."""
    folder = Path(data_dir) / "multihop_rag"
    queries = _read_json(folder / "queries_500.json")["queries"]
    truth = _read_json(folder / "ground_truth_500.json")
    facts: dict[str, list[str]] = defaultdict(list)
    titles: dict[str, str] = {}
    for query in queries:
        for evidence in truth.get(query["id"], {}).get("evidence_list", []):
            key = evidence.get("url") or evidence["title"]
            titles.setdefault(key, evidence["title"])
            if evidence["fact"] not in facts[key]:
                facts[key].append(evidence["fact"])
    blocks = {key: TraceBlock(key, f"{titles[key]}\n" + " ".join(facts[key])) for key in facts}
    requests = []
    for query in queries:
        keys: list[str] = []
        for evidence in truth.get(query["id"], {}).get("evidence_list", []):
            key = evidence.get("url") or evidence["title"]
            if key not in keys:
                keys.append(key)
        requests.append(TraceRequest(f"q{query['id']}", 0, query["question"], tuple(blocks[key] for key in keys)))
    return Trace("multihop", tuple(requests), multi_turn=False)


# ---------------------------------------------------------------- MT-RAG

def _mt_rag_reference(data_dir: Path) -> tuple[dict[str, list[TraceRequest]], dict[str, str]]:
    reference = _read_json(Path(data_dir) / "mt_rag" / "reference_subset_with_human_evaluations.json")
    texts = {doc["document_id"]: f"{doc.get('title') or ''}\n{doc['text']}".strip() for doc in reference["documents"]}
    conversations: dict[str, list[TraceRequest]] = defaultdict(list)
    for task in sorted(reference["tasks"], key=lambda task: (task["task_id"].split("<::>")[0], int(task["Turn"]))):
        conversation_id = task["task_id"].split("<::>")[0]
        query = next(message["text"] for message in reversed(task["input"]) if message["speaker"] == "user")
        ids = list(dict.fromkeys(context["document_id"] for context in task["contexts"]))
        blocks = tuple(TraceBlock(doc_id, texts[doc_id]) for doc_id in ids if doc_id in texts)
        answer = task["targets"][0]["text"] if task.get("targets") else None
        conversations[conversation_id].append(TraceRequest(conversation_id, int(task["Turn"]), query, blocks,
                                                           answer=answer))
    return conversations, texts


def _mt_rag_qrels(data_dir: Path, texts: dict[str, str], skip: set[str]) -> dict[str, list[TraceRequest]]:
    root = Path(data_dir) / "mt_rag" / "retrieval_tasks"
    if not root.is_dir():
        raise WorkloadDataError(f"workload data not found: expected {root}")
    passages: dict[tuple[str, int], list[str]] = defaultdict(list)
    questions: dict[str, str] = {}
    for domain in sorted(path for path in root.iterdir() if path.is_dir()):
        with (domain / "qrels" / "dev.tsv").open(encoding="utf-8") as handle:
            for row in csv.DictReader(handle, delimiter="\t"):
                conversation_id, turn = row["query-id"].split("<::>")
                passages[(conversation_id, int(turn))].append(row["corpus-id"])
        for line in (domain / f"{domain.name}_lastturn.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                item = json.loads(line)
                questions[item["_id"]] = item["text"].removeprefix("|user|:").strip()
    conversations: dict[str, list[TraceRequest]] = defaultdict(list)
    for (conversation_id, turn), ids in sorted(passages.items()):
        if conversation_id in skip:
            continue
        blocks = tuple(TraceBlock(doc_id, texts.get(doc_id) or _pseudo_text(doc_id, STAND_IN_TOKENS))
                       for doc_id in dict.fromkeys(ids))
        query = questions.get(f"{conversation_id}<::>{turn}", f"question {turn}")
        answer = "Answer: " + _pseudo_text(f"{conversation_id}/{turn}/answer", 40)
        conversations[conversation_id].append(TraceRequest(conversation_id, turn, query, blocks, answer=answer))
    return conversations


def interleave(conversations: Sequence[Sequence[TraceRequest]], concurrency: int) -> list[TraceRequest]:
    """Interleave conversations as ``concurrency`` concurrent sessions, round robin, in a deterministic order.

    A session that finishes is replaced by the next conversation. Turns of one conversation keep their order.
    """
    pending = list(conversations)[::-1]
    active: list[list[TraceRequest]] = []
    out: list[TraceRequest] = []
    while pending or active:
        while pending and len(active) < concurrency:
            active.append(list(pending.pop()))
        for turns in list(active):
            out.append(turns.pop(0))
            if not turns:
                active.remove(turns)
    return out


def load_mt_rag(data_dir: Path, *, concurrency: int = MT_RAG_CONCURRENCY) -> Trace:
    """Load MT-RAG as a multi-turn trace (see module docstring)."""
    reference, texts = _mt_rag_reference(data_dir)
    others = _mt_rag_qrels(data_dir, texts, skip=set(reference))
    conversations = [reference[key] for key in sorted(reference)] + [others[key] for key in sorted(others)]
    requests = interleave(conversations, concurrency)
    return Trace("mt_rag", tuple(requests), multi_turn=True)


# ---------------------------------------------------------------- synthetic

def load_synthetic(*, requests: int = 2000, blocks_per_request: int = 15, corpus_size: int = 1000,
                   zipf_exponent: float = 1.0, seed: int = 0, turns_per_session: int = 1,
                   repeat_fraction: float = 0.4, block_words: int | None = None, name: str = "synthetic") -> Trace:
    """Generate a seeded synthetic trace: Zipf block popularity over a shared corpus.

    Args:
        requests: number of requests.
        blocks_per_request: distinct blocks per request (at most ``corpus_size``).
        corpus_size: number of corpus blocks (80-240 pseudo-words each).
        zipf_exponent: popularity of the i-th most popular block is proportional to ``1 / i**zipf_exponent``.
        seed: the generator's seed (same seed, same trace).
        turns_per_session: turns per session; above 1 the trace is multi-turn.
        repeat_fraction: in multi-turn sessions, share of a turn's blocks drawn from the session's earlier blocks.
        block_words: every block this many pseudo-words long (default: 80 to 240, drawn per block).
        name: the trace's name.
    """
    if requests < 1 or not 1 <= blocks_per_request <= corpus_size or turns_per_session < 1:
        raise InvalidInputError("synthetic: need requests >= 1, 1 <= blocks_per_request <= corpus_size, turns >= 1")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(80, 241, size=corpus_size)
    if block_words is not None:
        lengths[:] = block_words
    corpus = [TraceBlock(f"doc{i}", f"Document {i}. " + _pseudo_text(f"synthetic/{seed}/{i}", int(lengths[i])))
              for i in range(corpus_size)]
    popularity = 1.0 / np.arange(1, corpus_size + 1) ** zipf_exponent
    popularity = popularity[np.argsort(rng.permutation(corpus_size))]
    popularity /= popularity.sum()
    sessions: list[list[TraceRequest]] = []
    for index in range(requests):
        session_number, turn = divmod(index, turns_per_session)
        if turn == 0:
            sessions.append([])
        earlier = [block.id for request in sessions[-1] for block in request.blocks]
        chosen = _draw_blocks(rng, popularity, blocks_per_request, earlier, repeat_fraction)
        query = f"Question {index}: " + _pseudo_text(f"synthetic/{seed}/query/{index}", 12)
        sessions[-1].append(TraceRequest(f"s{session_number}", turn + 1, query,
                                         tuple(corpus[int(i[3:])] for i in chosen),
                                         answer=f"Answer {index}: " + _pseudo_text(f"synthetic/{seed}/a/{index}", 30)))
    ordered = interleave(sessions, 8) if turns_per_session > 1 else [s[0] for s in sessions]
    return Trace(name, tuple(ordered), multi_turn=turns_per_session > 1)


def _draw_blocks(rng: np.random.Generator, popularity: np.ndarray, count: int, earlier: list[str],
                 repeat_fraction: float) -> list[str]:
    unique_earlier = list(dict.fromkeys(earlier))
    repeats = min(len(unique_earlier), round(count * repeat_fraction)) if unique_earlier else 0
    chosen = [unique_earlier[i] for i in rng.choice(len(unique_earlier), size=repeats, replace=False)] if repeats else []
    while len(chosen) < count:
        for i in rng.choice(len(popularity), size=count, replace=False, p=popularity):
            doc_id = f"doc{int(i)}"
            if doc_id not in chosen and len(chosen) < count:
                chosen.append(doc_id)
    order = rng.permutation(len(chosen))
    return [chosen[i] for i in order]


LOADERS: dict[str, Callable[[Path], Trace]] = {
    "locomo": load_locomo,
    "mt_rag": load_mt_rag,
    "multihop": load_multihop,
    "synthetic": lambda _data_dir: load_synthetic(),
    "locomo_sessions": load_locomo_sessions,
    "synthetic300": lambda _data_dir: load_synthetic(block_words=SYNTHETIC300_WORDS, name="synthetic300"),
}


def load_workload(name: str, data_dir: Path | None = None) -> Trace:
    """Load a named workload (one of :data:`WORKLOADS`) from ``data_dir`` (default: :func:`default_data_dir`).

    Raises:
        InvalidInputError: unknown workload name.
        WorkloadDataError: the data file is missing (the message names the expected path).
    """
    if name not in LOADERS:
        raise InvalidInputError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return LOADERS[name](Path(data_dir) if data_dir is not None else default_data_dir())
