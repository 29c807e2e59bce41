"""The prompts of each condition, built once and deterministically before anything is asked.

Conditions (every question is asked under each, on the same engine):

* ``original``: the blocks in relevance order, every block in full, no annotation; a chat's history is its own
  earlier user messages (every block in full) and the recorded replies.
* ``reordered``: the blocks in cpmemory's prompt order (the order ``cpmemory`` shows them, references included),
  every block in full, no annotation; its own history likewise.
* ``cpmemory``: what cpmemory sends: its order and, where that differs from the relevance order, the order
  annotation; in a multi-turn chat a block already shown earlier in the conversation is a reference line (the
  default de-duplication) and the history is cpmemory's stored transcript. Single-turn questions get the order of
  an offline plan of the whole dataset (``plan_batch``, cross-session reordering); LoCoMo goes through the Mem0
  adapter (``mem0_cpmemory.CpMemoryMem0`` over a stand-in memory whose search returns the question's blocks).

A turn's reply in every history is the question's recorded reply (the gold answer), so the conditions differ only
in how the blocks are written. Each prompt is checked by ``cpmemory.core.invariants.check_no_loss`` (every block
reaches the model, the relevance order is recoverable where the condition promises it): its violations count as
``lost``. A cpmemory turn whose gold evidence reached the model only as a reference to an earlier turn is flagged
``by_reference`` (scored apart).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cpmemory import Block, CpMemory
from cpmemory.adapters import passthrough_messages, prompt_ranks
from cpmemory.core.invariants import check_no_loss
from cpmemory.session.config import DEFAULT_SYSTEM_PROMPT
from cpmemory_benchmarks.accuracy_data import Question

CONDITIONS = ("original", "reordered", "cpmemory")
BASELINE = "original"
SHORT_ANSWER = " Reply with the answer only, in a few words."
SYSTEM_PROMPTS = {
    "multihop": DEFAULT_SYSTEM_PROMPT + SHORT_ANSWER,
    "locomo": DEFAULT_SYSTEM_PROMPT + SHORT_ANSWER,
    "mt_rag": DEFAULT_SYSTEM_PROMPT + " Reply in one or two sentences.",
}
BY_REFERENCE_STATUSES = frozenset({"referenced"})


@dataclass(frozen=True, slots=True)
class Prompt:
    """One question under one condition: what is sent, and what the no-loss check found."""

    question: Question
    condition: str
    messages: tuple[Mapping[str, Any], ...]
    lost: int = 0
    by_reference: bool = False
    violations: tuple[str, ...] = field(default=())

    @property
    def sha(self) -> str:
        """A digest of what is asked (messages and scoring kind): a record is reused only for the same prompt."""
        body = json.dumps([self.question.kind, list(self.messages)], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


class _StandInMem0:
    """A Mem0-shaped memory whose ``search`` returns the blocks set for the next call (the adapter's input)."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def search(self, query: str, **_options: Any) -> dict[str, Any]:
        return {"results": list(self.results)}


def _checked(question: Question, condition: str, messages: Sequence[Mapping[str, Any]],
             by_reference: bool = False) -> Prompt:
    report = check_no_loss(question.blocks, messages, check_order=condition != "reordered", query=question.query)
    return Prompt(question, condition, tuple(dict(m) for m in messages), len(report.violations), by_reference,
                  tuple(report.violations))


def _plain(question: Question, blocks: Sequence[Block], history: list[dict[str, Any]], system: str,
           condition: str) -> Prompt:
    messages = passthrough_messages(question.query, blocks, history=history, system_prompt=system)
    history.extend([messages[-1], {"role": "assistant", "content": question.reply}])
    return _checked(question, condition, messages)


def _by_reference(question: Question, statuses: Mapping[str, str]) -> bool:
    return any(statuses.get(block_id) in BY_REFERENCE_STATUSES for block_id in question.evidence)


def build_prompts(chats: Sequence[Sequence[Question]], *, plan_over: Sequence[Sequence[Question]] | None = None,
                  via_mem0: bool = False, conditions: Sequence[str] = CONDITIONS) -> list[dict[str, Prompt]]:
    """Every question's prompt under each condition, chat by chat, turn by turn.

    Args:
        chats: the chats to ask (their questions in turn order).
        plan_over: single-turn datasets: the questions whose offline plan fixes cpmemory's order (the whole
            dataset, so the order of a question does not depend on how many are asked); None for multi-turn.
        via_mem0: build cpmemory's prompts through the Mem0 adapter.
        conditions: which conditions to return (each question's dict holds these).

    Returns:
        One dict per question (chat order, then turn order): condition -> Prompt.
    """
    memory = CpMemory()
    planned: dict[str, list[str]] = {}
    if plan_over is not None:
        questions = [q for chat in plan_over for q in chat]
        plan = memory.plan_batch([list(q.blocks) for q in questions])
        planned = {q.qid: [str(i) for i in ids] for q, ids in zip(questions, plan.contexts)}
        memory = CpMemory()  # the plan fixed the order; prompts are prepared on a fresh facade
    stand_in = _StandInMem0()
    adapter = None
    if via_mem0:
        from mem0_cpmemory import CpMemoryMem0

        system = SYSTEM_PROMPTS[chats[0][0].dataset] if chats and chats[0] else None
        adapter = CpMemoryMem0(stand_in, memory, system_prompt=system)
    out: list[dict[str, Prompt]] = []
    for chat in chats:
        original: list[dict[str, Any]] = []
        reordered: list[dict[str, Any]] = []
        for question in chat:
            system = SYSTEM_PROMPTS[question.dataset]
            turn, commit = _prepare(memory, adapter, stand_in, question, system, planned.get(question.qid))
            statuses = {d.block_id: str(getattr(d.status, "value", d.status)) for d in turn.decisions}
            in_prompt_order = [question.blocks[rank] for rank in prompt_ranks(turn.decisions)]
            prompts = {
                "original": _plain(question, question.blocks, original, system, "original"),
                "reordered": _plain(question, in_prompt_order, reordered, system, "reordered"),
                "cpmemory": _checked(question, "cpmemory", turn.messages, _by_reference(question, statuses)),
            }
            commit(question.reply)
            out.append({name: prompts[name] for name in conditions})
    return out


def _prepare(memory: CpMemory, adapter: Any, stand_in: _StandInMem0, question: Question, system: str,
             order: list[str] | None) -> tuple[Any, Any]:
    """cpmemory's prepared turn for ``question`` and the function that commits its reply."""
    if adapter is None:
        turn = memory.prepare(question.chat, question.query, list(question.blocks), system_prompt=system,
                              prompt_order=order)
        return turn, lambda reply: memory.commit(turn, reply)
    stand_in.results = [{"id": block.id, "memory": block.text, "score": 1.0 - rank / 100}
                        for rank, block in enumerate(question.blocks)]
    adapter.search(question.query, run_id=question.chat, user_id="accuracy")
    prepared = adapter.pending_turn(question.chat)
    if prepared is None:
        raise RuntimeError(f"the Mem0 adapter prepared no turn for {question.chat}")
    return _Turn(adapter.chat_messages(question.chat), prepared.decisions), lambda reply: adapter.commit(reply, conversation_id=question.chat)


@dataclass(frozen=True, slots=True)
class _Turn:
    messages: list[dict[str, Any]]
    decisions: Any
