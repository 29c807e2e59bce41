"""The accuracy study's questions: real QA sets from ``../shared/data`` as chats of questions with gold answers.

* ``multihop`` (MultiHop-RAG, single turn): the answerable queries (``null_query`` left out, its gold answer is a
  refusal). Each distinct evidence article is one block (title, source, date, then its evidence sentences); a
  query's blocks are its gold articles among the best BM25 distractors from every other article, in BM25 order
  (the relevance order), ``top_k`` in all. Gold answers "yes"/"no" make a yes/no question (scored by the engine's
  logprobs of "Yes" against "No").
* ``locomo`` (LoCoMo through the Mem0 adapter, multi-turn): each conversation's QA questions (the adversarial
  category, which has no gold answer, left out) asked in order as the turns of chats of ``turns_per_chat``
  questions; each turn's blocks are the ``top_k`` dialog turns of its conversation by BM25 (a Mem0 memory search),
  each dated with its session; the gold evidence is the QA's ``evidence`` dialog turns.
* ``mt_rag`` (MT-RAG, multi-turn RAG): the 20 conversations whose passages are stored, each turn's reference
  passages as its blocks (all of them its evidence), every turn with a reference answer (159).

Questions are returned as chats (lists of turns), in a seeded order, so that the first ``limit`` questions are a
random sample of whole chats. Pure reading; nothing is written.
"""
from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpmemory import Block
from cpmemory.bench.loaders import locomo_turns
from cpmemory.errors import InvalidInputError, MissingDependencyError

DATASETS = ("multihop", "locomo", "mt_rag")
YES_NO = ("yes", "no")
YES_NO_SUFFIX = " Answer Yes or No."
MULTIHOP_TOP_K = 6
LOCOMO_TOP_K = 10
LOCOMO_TURNS_PER_CHAT = 6
_EVIDENCE_ID = re.compile(r"D\d+:\d+")


class AccuracyDataError(InvalidInputError):
    """A dataset file is missing or unreadable; the message names the path."""


@dataclass(frozen=True, slots=True)
class Question:
    """One question of a chat.

    Attributes:
        dataset: the dataset's name.
        qid: unique within the dataset.
        chat: the chat (conversation) it is asked in; single-turn questions have a chat each.
        turn: its position in the chat, from 1.
        query: the question as asked.
        blocks: its context blocks, most relevant first.
        golds: the gold answers (any one counts).
        evidence: ids of the blocks holding the gold evidence.
        kind: "free" (a generated answer) or "yesno" (scored by the logprobs of Yes and No).
        reply: the assistant's answer recorded in the chat's history for later turns (the gold answer, the same
            under every condition, so a turn's history does not depend on the model's earlier answers).
        category: the dataset's question type.
    """

    dataset: str
    qid: str
    chat: str
    turn: int
    query: str
    blocks: tuple[Block, ...]
    golds: tuple[str, ...]
    evidence: frozenset[str]
    kind: str
    reply: str
    category: str


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise AccuracyDataError(f"dataset file not found: expected {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise AccuracyDataError(f"cannot read {path}: {error}") from error


def _bm25_ranking(corpus: Sequence[str], queries: Sequence[str], k: int) -> list[list[int]]:
    try:
        import bm25s
    except ImportError as error:
        raise MissingDependencyError("bench", "bm25s") from error
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(list(corpus), stopwords="en", show_progress=False), show_progress=False)
    tokens = bm25s.tokenize(list(queries), stopwords="en", show_progress=False)
    results, _scores = retriever.retrieve(tokens, k=min(k, len(corpus)), show_progress=False, n_threads=1)
    return [[int(i) for i in row] for row in results]


def _shuffled(chats: list[list[Question]], seed: int) -> list[list[Question]]:
    random.Random(seed).shuffle(chats)
    return chats


# ---------------------------------------------------------------- MultiHop-RAG

def load_multihop(data_dir: Path, *, top_k: int = MULTIHOP_TOP_K, seed: int = 0) -> list[list[Question]]:
    """MultiHop-RAG's answerable queries, each a chat of one turn (module docstring)."""
    folder = Path(data_dir) / "multihop_rag"
    queries = _read_json(folder / "queries_500.json")["queries"]
    truth = _read_json(folder / "ground_truth_500.json")
    facts: dict[str, list[str]] = {}
    heads: dict[str, str] = {}
    for query in queries:
        for evidence in truth.get(query["id"], {}).get("evidence_list", []):
            key = evidence.get("url") or evidence["title"]
            date = str(evidence.get("published_at") or "")[:10]
            heads.setdefault(key, f"{evidence['title']} ({evidence.get('source') or 'unknown source'}, {date})")
            facts.setdefault(key, [])
            if evidence["fact"] not in facts[key]:
                facts[key].append(evidence["fact"])
    keys = list(facts)
    blocks = [Block(key, heads[key] + "\n" + " ".join(facts[key])) for key in keys]
    answerable = [q for q in queries if q.get("question_type") != "null_query" and q["id"] in truth]
    ranking = _bm25_ranking([block.text for block in blocks], [q["question"] for q in answerable], len(blocks))
    chats = []
    for query, ranked in zip(answerable, ranking):
        gold_keys = list(dict.fromkeys(e.get("url") or e["title"] for e in truth[query["id"]]["evidence_list"]))
        gold = {keys.index(key) for key in gold_keys}
        distractors = [i for i in ranked if i not in gold][: max(0, top_k - len(gold))]
        chosen = set(distractors) | gold
        position = {index: rank for rank, index in enumerate(ranked)}
        ordered = sorted(chosen, key=lambda index: position.get(index, len(ranked)))
        answer = str(truth[query["id"]]["answer"]).strip()
        kind = "yesno" if answer.lower() in YES_NO else "free"
        text = query["question"] + (YES_NO_SUFFIX if kind == "yesno" else "")
        qid = f"q{query['id']}"
        chats.append([Question("multihop", qid, qid, 1, text, tuple(blocks[i] for i in ordered),
                               (answer.capitalize() if kind == "yesno" else answer,), frozenset(gold_keys), kind,
                               answer, str(query.get("question_type", "")))])
    return _shuffled(chats, seed)


# ---------------------------------------------------------------- LoCoMo

def _locomo_memories(sample: dict[str, Any]) -> list[Block]:
    return [Block(turn.id, turn.text) for turn in locomo_turns(sample, dated=True)]


def load_locomo(data_dir: Path, *, top_k: int = LOCOMO_TOP_K, turns_per_chat: int = LOCOMO_TURNS_PER_CHAT,
                seed: int = 0) -> list[list[Question]]:
    """LoCoMo's answerable questions as chats of ``turns_per_chat`` turns (module docstring)."""
    if turns_per_chat < 1 or top_k < 1:
        raise InvalidInputError("locomo: turns_per_chat and top_k must be at least 1")
    samples = _read_json(Path(data_dir) / "locomo" / "locomo10.json")
    chats: list[list[Question]] = []
    for sample in samples:
        memories = _locomo_memories(sample)
        qas = [(index, qa) for index, qa in enumerate(sample["qa"]) if qa.get("answer") not in (None, "")]
        ranking = _bm25_ranking([m.text for m in memories], [str(qa["question"]) for _, qa in qas], top_k)
        for start in range(0, len(qas), turns_per_chat):
            chat_id = f"{sample['sample_id']}/c{start // turns_per_chat}"
            chat = []
            for turn, ((index, qa), ranked) in enumerate(zip(qas[start:start + turns_per_chat],
                                                             ranking[start:start + turns_per_chat]), start=1):
                evidence = frozenset(f"{sample['sample_id']}:{e}"
                                     for e in _EVIDENCE_ID.findall(" ".join(map(str, qa.get("evidence", [])))))
                answer = str(qa["answer"])
                chat.append(Question("locomo", f"{sample['sample_id']}:q{index}", chat_id, turn, str(qa["question"]),
                                     tuple(memories[i] for i in ranked), (answer,), evidence, "free", answer,
                                     str(qa.get("category", ""))))
            chats.append(chat)
    return _shuffled(chats, seed)


# ---------------------------------------------------------------- MT-RAG

def load_mt_rag(data_dir: Path, *, seed: int = 0) -> list[list[Question]]:
    """MT-RAG's conversations with stored passages, every turn (module docstring)."""
    reference = _read_json(Path(data_dir) / "mt_rag" / "reference_subset_with_human_evaluations.json")
    texts = {doc["document_id"]: f"{doc.get('title') or ''}\n{doc['text']}".strip() for doc in reference["documents"]}
    by_chat: dict[str, list[dict[str, Any]]] = {}
    for task in reference["tasks"]:
        by_chat.setdefault(task["task_id"].split("<::>")[0], []).append(task)
    chats = []
    for chat_id in sorted(by_chat):
        chat: list[Question] = []
        for task in sorted(by_chat[chat_id], key=lambda task: int(task["Turn"])):
            query = next(m["text"] for m in reversed(task["input"]) if m["speaker"] == "user")
            ids = [i for i in dict.fromkeys(c["document_id"] for c in task["contexts"]) if i in texts]
            answer = task["targets"][0]["text"] if task.get("targets") else ""
            if not answer.strip():
                continue
            kind = task.get("Question Type") or [""]
            chat.append(Question("mt_rag", task["task_id"], chat_id, len(chat) + 1, query,
                                 tuple(Block(i, texts[i]) for i in ids), (answer,), frozenset(ids), "free", answer,
                                 ",".join(kind) if isinstance(kind, list) else str(kind)))
        if chat:
            chats.append(chat)
    return _shuffled(chats, seed)


def load(name: str, data_dir: Path, *, seed: int = 0) -> list[list[Question]]:
    """The named dataset's chats (one of :data:`DATASETS`)."""
    loaders: dict[str, Callable[..., list[list[Question]]]] = {"multihop": load_multihop, "locomo": load_locomo, "mt_rag": load_mt_rag}
    if name not in loaders:
        raise InvalidInputError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    return loaders[name](data_dir, seed=seed)


def select(chats: Sequence[Sequence[Question]], limit: int | None) -> list[list[Question]]:
    """The first whole chats holding at least ``limit`` questions (all of them for None)."""
    chosen: list[list[Question]] = []
    count = 0
    for chat in chats:
        if limit is not None and count >= limit:
            break
        chosen.append(list(chat))
        count += len(chat)
    return chosen
