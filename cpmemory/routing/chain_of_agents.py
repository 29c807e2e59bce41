"""Chain-of-Agents: workers read a long input chunk by chunk, passing a running summary; a manager answers.

Every call of one job starts with the same system message (the job's system prompt and its shared context blocks),
so every call after the first can reuse that prefix from the engine's cache, provided all calls land on the replica
that holds it. The helper therefore routes every call of a job with one affinity key (tenant + job id), and reports
for each call which replica answered and how many prompt tokens the engine served from its cache.

Usage::

    coa = ChainOfAgents(dispatcher)
    result = await coa.run("job-1", "Who founded the company?", long_text, context_blocks=blocks)
    result.answer, result.cached_tokens, [call.replica_index for call in result.calls]
"""
from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cpmemory.core.annotations import format_block
from cpmemory.core.blocks import BlockLike, normalize_blocks
from cpmemory.engines.openai_wire import chat_body, request_headers, response_text, usage_tokens
from cpmemory.errors import InvalidInputError
from cpmemory.routing.dispatch import Dispatcher
from cpmemory.routing.router import job_affinity_key

DEFAULT_SYSTEM_PROMPT = "You are one agent of a team reading a long document to complete a task."


class ChainOfAgentsConfig(BaseModel):
    """Tunables of a Chain-of-Agents job."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "default"
    chunk_chars: int = Field(default=4000, ge=1)
    max_chunks: int = Field(default=64, ge=1)
    worker_max_tokens: int = Field(default=256, ge=1)
    manager_max_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    affinity: Literal["job", "call"] = Field(
        default="job", description="'job': every call of a job goes to one replica; 'call': each call is routed on "
        "its own (the baseline without agent-aware routing, for benchmarks)")


@dataclass(frozen=True, slots=True)
class AgentCall:
    """One engine call of a job: who made it, where it went, what the engine cached."""

    role: Literal["worker", "manager"]
    index: int
    request_id: str
    replica_index: int
    replica_url: str
    route_reason: str
    prompt_tokens: int
    cached_tokens: int
    output: str


@dataclass(frozen=True, slots=True)
class ChainOfAgentsResult:
    """The outcome of one job."""

    job_id: str
    answer: str
    worker_outputs: tuple[str, ...]
    calls: tuple[AgentCall, ...]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the engine's cache, over every call."""
        return sum(call.cached_tokens for call in self.calls)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over every call."""
        return sum(call.prompt_tokens for call in self.calls)

    @property
    def replicas(self) -> frozenset[int]:
        """Replica indexes the job's calls went to (one, unless a replica failed during the job)."""
        return frozenset(call.replica_index for call in self.calls)


def split_chunks(text: str, chunk_chars: int, max_chunks: int | None = None) -> list[str]:
    """Split ``text`` into consecutive chunks of about ``chunk_chars`` characters, cutting after whitespace.

    Nothing is lost: ``"".join(split_chunks(text, n)) == text``. With ``max_chunks``, the chunk size grows so the text
    fits in that many chunks. Pure, O(len(text)).
    """
    if chunk_chars < 1:
        raise InvalidInputError("chunk_chars must be at least 1")
    if max_chunks is not None and max_chunks >= 1 and len(text) > chunk_chars * max_chunks:
        chunk_chars = -(-len(text) // max_chunks)
    chunks: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        if max_chunks is not None and len(chunks) + 1 >= max_chunks:
            end = len(text)  # the last allowed chunk takes the rest (cuts after whitespace may have made them short)
        if end < len(text):
            cut = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
            if cut > start:
                end = cut + 1
        chunks.append(text[start:end])
        start = end
    return chunks


class ChainOfAgents:
    """Runs Chain-of-Agents jobs through a ``Dispatcher`` (one replica per job)."""

    def __init__(self, dispatcher: Dispatcher, config: ChainOfAgentsConfig | None = None) -> None:
        """No IO; ``dispatcher`` carries the router and the transport."""
        self.dispatcher = dispatcher
        self.config = config or ChainOfAgentsConfig()

    async def run(
        self,
        job_id: str,
        task: str,
        long_input: str,
        *,
        tenant: str = "default",
        context_blocks: Iterable[BlockLike] = (),
        system_prompt: str | None = None,
        affinity_key: str | None = None,
    ) -> ChainOfAgentsResult:
        """Run one job: one worker per chunk (sequential, passing the summary), then the manager.

        Every call is routed with ``affinity_key`` (default: tenant + job id; pass ``branch_affinity_key(tenant,
        search_path)`` to co-locate jobs whose contexts share an index branch).

        Raises:
            InvalidInputError: empty job id or task, or malformed blocks.
            NoHealthyReplicaError / EngineStatusError: the engine could not serve a call (the job stops there).
        """
        if not job_id or not task:
            raise InvalidInputError("a Chain-of-Agents job needs a job id and a task")
        shared = self._shared_system_message(system_prompt, context_blocks)
        key = affinity_key or job_affinity_key(tenant, job_id)
        chunks = split_chunks(long_input, self.config.chunk_chars, self.config.max_chunks) or [""]
        calls: list[AgentCall] = []
        summary = ""
        for position, chunk in enumerate(chunks):
            prompt = _worker_prompt(task, summary, chunk, position, len(chunks))
            call = await self._call(key, job_id, "worker", position, shared, prompt, self.config.worker_max_tokens)
            calls.append(call)
            summary = call.output
        manager = await self._call(
            key, job_id, "manager", 0, shared, _manager_prompt(task, summary), self.config.manager_max_tokens
        )
        calls.append(manager)
        return ChainOfAgentsResult(job_id, manager.output, tuple(c.output for c in calls[:-1]), tuple(calls))

    async def run_many(
        self, jobs: Sequence[tuple[str, str, str]], *, tenant: str = "default", concurrency: int = 8, **shared: Any
    ) -> list[ChainOfAgentsResult]:
        """Run ``(job_id, task, long_input)`` jobs concurrently (at most ``concurrency`` at once), in input order."""
        limit = asyncio.Semaphore(max(1, concurrency))

        async def one(job: tuple[str, str, str]) -> ChainOfAgentsResult:
            async with limit:
                return await self.run(job[0], job[1], job[2], tenant=tenant, **shared)

        return list(await asyncio.gather(*(one(job) for job in jobs)))

    def _shared_system_message(self, system_prompt: str | None, context_blocks: Iterable[BlockLike]) -> str:
        blocks = normalize_blocks(context_blocks)
        parts = [system_prompt or DEFAULT_SYSTEM_PROMPT]
        parts.extend(format_block(block.label, block.text) for block in blocks)
        return "\n\n".join(parts)

    async def _call(
        self, key: str, job_id: str, role: Literal["worker", "manager"], index: int, system: str, user: str,
        max_tokens: int,
    ) -> AgentCall:
        request_id = _request_id(job_id, role, index)
        if self.config.affinity == "call":
            key = f"{key}|{request_id}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        payload = chat_body(messages, model=self.config.model, request_id=request_id, stream=False,
                            max_tokens=max_tokens, extra={"temperature": self.config.temperature})
        result = await self.dispatcher.complete(key, payload, request_headers(request_id))
        prompt_tokens, cached_tokens = usage_tokens(result.response)
        return AgentCall(
            role, index, request_id, result.decision.index, result.decision.url, result.decision.reason,
            prompt_tokens, cached_tokens, response_text(result.response),
        )


def _request_id(job_id: str, role: str, index: int) -> str:
    # Job ids are caller text: hash them so request ids stay short and safe in headers and logs.
    digest = hashlib.blake2b(job_id.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"coa-{digest}-{role}-{index}"


def _worker_prompt(task: str, summary: str, chunk: str, position: int, total: int) -> str:
    return (
        f"Task: {task}\n\nSummary so far:\n{summary or '(none yet)'}\n\n"
        f"Source part {position + 1} of {total}:\n{chunk}\n\n"
        "Rewrite the summary, keeping everything from this part that helps with the task."
    )


def _manager_prompt(task: str, summary: str) -> str:
    return f"Task: {task}\n\nSummary written by the workers:\n{summary}\n\nAnswer the task."
