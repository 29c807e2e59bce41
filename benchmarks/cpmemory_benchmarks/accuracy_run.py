"""Asking the engine and keeping every answer: the chat client, the JSONL records, the resumable run.

The engine is any OpenAI-compatible server (vLLM) reached at ``/v1/chat/completions``: the model's own chat template,
greedy decoding (temperature 0). A yes/no question asks for one token with its top logprobs and answers "Yes" or
"No", whichever the model gives the higher probability (summed over the spellings of each).

Every answer is one JSON line (:class:`Record`), appended as soon as it comes: an unreachable engine, an HTTP error,
a malformed reply or an empty answer is recorded as such (``error`` / ``empty``) and counted, never scored. A run
reads its file first and asks again only what it lacks: a question under a condition is done when a record with
the same model and the same prompt digest answered it (an error is asked again; a prompt that changed, e.g. after
an edit of the annotation's wording, is asked again).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from cpmemory_benchmarks.accuracy_prompts import Prompt

DEFAULT_MAX_TOKENS = 64
TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Reply:
    """What the engine answered (or why it did not)."""

    answer: str = ""
    answer_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    yes_logprob: float | None = None
    no_logprob: float | None = None
    error: str | None = None


def _logsumexp(values: Sequence[float]) -> float | None:
    if not values:
        return None
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def parse_reply(body: Mapping[str, Any], *, yesno: bool) -> Reply:
    """Read a chat completion body; a malformed one is a Reply with ``error`` set. Pure."""
    try:
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        common = Reply(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                       cached_tokens=int(details.get("cached_tokens") or 0),
                       finish_reason=str(choice.get("finish_reason") or ""))
        if not yesno:
            text = choice["message"].get("content") or ""
            return replace(common, answer=text.strip(), answer_tokens=int(usage.get("completion_tokens") or 0))
        top = choice["logprobs"]["content"][0]["top_logprobs"]
        yes = _logsumexp([float(t["logprob"]) for t in top if t["token"].strip().lower() == "yes"])
        no = _logsumexp([float(t["logprob"]) for t in top if t["token"].strip().lower() == "no"])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        return Reply(error=f"malformed reply: {type(error).__name__}: {error}")
    if yes is None and no is None:
        return replace(common, error="neither Yes nor No among the top logprobs")
    answer = "Yes" if (yes if yes is not None else -math.inf) >= (no if no is not None else -math.inf) else "No"
    return replace(common, answer=answer, answer_tokens=1, yes_logprob=yes, no_logprob=no)


class ChatEngine:
    """An OpenAI-compatible chat endpoint, asked greedily. Never raises for what the engine does."""

    def __init__(self, url: str, model: str, *, max_tokens: int = DEFAULT_MAX_TOKENS, timeout_s: float = 600.0,
                 client: httpx.AsyncClient | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.max_tokens = max_tokens
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    async def ask(self, messages: Sequence[Mapping[str, Any]], *, yesno: bool) -> Reply:
        """One greedy completion of ``messages`` (one token with logprobs for a yes/no question)."""
        body: dict[str, Any] = {"model": self.model, "messages": list(messages), "temperature": 0.0, "seed": 0,
                                "max_tokens": 1 if yesno else self.max_tokens}
        if yesno:
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        try:
            response = await self._client.post(f"{self.url}/v1/chat/completions", json=body)
        except httpx.HTTPError as error:
            return Reply(error=f"unreachable: {type(error).__name__}: {error}")
        if response.status_code != 200:
            return Reply(error=f"http {response.status_code}: {response.text[:300]}")
        try:
            payload = response.json()
        except ValueError:
            return Reply(error=f"not JSON: {response.text[:200]}")
        return parse_reply(payload, yesno=yesno)

    async def aclose(self) -> None:
        await self._client.aclose()


async def served_model(url: str, client: httpx.AsyncClient | None = None) -> str:
    """The first model the engine serves (``/v1/models``)."""
    owned = client is None
    client = client or httpx.AsyncClient(timeout=30.0)
    try:
        response = await client.get(f"{url.rstrip('/')}/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    finally:
        if owned:
            await client.aclose()


@dataclass(frozen=True, slots=True)
class Record:
    """One question asked under one condition (a line of the JSONL file)."""

    dataset: str
    qid: str
    chat: str
    turn: int
    condition: str
    kind: str
    category: str
    model: str
    prompt_sha: str
    answer: str
    answer_tokens: int
    prompt_tokens: int
    cached_tokens: int
    latency_s: float
    finish_reason: str
    by_reference: bool
    lost: int
    error: str | None
    empty: bool
    yes_logprob: float | None = None
    no_logprob: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.dataset, self.qid, self.condition)

    @property
    def ok(self) -> bool:
        """Answered: no error and a non-empty answer (what is scored)."""
        return self.error is None and not self.empty


def make_record(prompt: Prompt, model: str, reply: Reply, latency_s: float) -> Record:
    question = prompt.question
    return Record(question.dataset, question.qid, question.chat, question.turn, prompt.condition, question.kind,
                  question.category, model, prompt.sha, reply.answer, reply.answer_tokens,
                  reply.prompt_tokens, reply.cached_tokens, round(latency_s, 3), reply.finish_reason,
                  prompt.by_reference, prompt.lost, reply.error, reply.error is None and not reply.answer.strip(),
                  reply.yes_logprob, reply.no_logprob)


_FIELDS = tuple(Record.__dataclass_fields__)


class RecordFile:
    """The run's JSONL file: read once, appended to line by line (flushed each time)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._tail_checked = False

    def load(self) -> list[Record]:
        """Every record in the file, in order; a torn last line (an interrupted write) is skipped."""
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
                records.append(Record(**{name: fields[name] for name in _FIELDS if name in fields}))
            except (ValueError, TypeError, AttributeError):
                continue
        return records

    def append(self, record: Record) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._tail_checked:
            self._tail_checked = True
            if self.path.is_file() and self.path.stat().st_size:
                with self.path.open("rb") as handle:
                    handle.seek(-1, 2)
                    torn = handle.read(1) != b"\n"
                if torn:  # an interrupted write left half a line: end it, so the next record is a line of its own
                    with self.path.open("a", encoding="utf-8") as handle:
                        handle.write("\n")
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
            handle.flush()


def latest(records: Iterable[Record], model: str) -> dict[tuple[str, str, str], Record]:
    """The last record of each (dataset, question, condition) for ``model``, keyed."""
    out: dict[tuple[str, str, str], Record] = {}
    for record in records:
        if record.model == model:
            out[record.key] = record
    return out


def pending(prompts: Sequence[Mapping[str, Prompt]], done: Mapping[tuple[str, str, str], Record]) -> list[Prompt]:
    """The prompts still to ask, question by question (so an interrupted run leaves whole questions done)."""
    todo = []
    for by_condition in prompts:
        for prompt in by_condition.values():
            record = done.get((prompt.question.dataset, prompt.question.qid, prompt.condition))
            if record is None or record.prompt_sha != prompt.sha or record.error is not None:
                todo.append(prompt)
    return todo


async def ask_all(engines: Sequence[ChatEngine], todo: Sequence[Prompt], records: RecordFile, *,
                  concurrency: int = 1, advance: Callable[[Record], None] | None = None,
                  deadline: float | None = None, clock: Callable[[], float] = time.monotonic) -> list[Record]:
    """Ask every prompt of ``todo`` and append each record as it comes. Returns the new records.

    The prompts of one chat (every turn, every condition) go to one engine, in order: a turn's history and the
    block order shared by ``reordered`` and ``cpmemory`` are then in that engine's prefix cache. Each engine takes
    ``concurrency`` chats at a time, the next one when it is free. Stops taking new prompts once ``clock()`` passes
    ``deadline`` (those in flight finish).
    """
    chats: dict[tuple[str, str], list[Prompt]] = {}
    for prompt in todo:
        chats.setdefault((prompt.question.dataset, prompt.question.chat), []).append(prompt)
    queue: asyncio.Queue[list[Prompt]] = asyncio.Queue()
    for chat in chats.values():
        queue.put_nowait(chat)
    written: list[Record] = []

    async def worker(engine: ChatEngine) -> None:
        while not queue.empty():
            for prompt in queue.get_nowait():
                if deadline is not None and clock() >= deadline:
                    return
                start = clock()
                reply = await engine.ask(prompt.messages, yesno=prompt.question.kind == "yesno")
                record = make_record(prompt, engine.model, reply, clock() - start)
                records.append(record)
                written.append(record)
                if advance is not None:
                    advance(record)

    await asyncio.gather(*(worker(engine) for engine in engines for _ in range(max(1, concurrency))))
    return written
