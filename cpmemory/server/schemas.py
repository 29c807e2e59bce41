"""Wire schemas of the proxy (pydantic v2): the OpenAI-compatible request, the ``cpmemory`` extension, errors.

The chat request keeps unknown fields (``extra="allow"``) so any OpenAI / vLLM sampling option passes through to the
engine untouched. The ``cpmemory`` extension is strict (``extra="forbid"``, no type coercion): a malformed extension
is answered with a typed 4xx error before anything is stored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from cpmemory.types import MAX_IDENTIFIER_CHARS, Status

MAX_BLOCKS = 2000
MAX_TEXT_CHARS = 4_000_000


def _encodable(value: str) -> str:
    # Lone surrogates survive JSON decoding but cannot be stored or tokenized; reject them at the door.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from error
    return value


class BlockIn(BaseModel):
    """One context block as sent by the caller."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: StrictStr | StrictInt = Field(description="caller's stable block id (never shown to the model)")
    text: StrictStr = Field(max_length=MAX_TEXT_CHARS)
    metadata: dict[str, Any] | None = None

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str | int) -> str | int:
        if isinstance(value, str):
            if not 0 < len(value) <= MAX_IDENTIFIER_CHARS:
                raise ValueError(f"block id must have 1 to {MAX_IDENTIFIER_CHARS} characters")
            _encodable(value)
        return value

    @field_validator("text")
    @classmethod
    def _check_text(cls, value: str) -> str:
        return _encodable(value)


class CpMemoryExtension(BaseModel):
    """The ``cpmemory`` field of a chat request: turn this call into a cpmemory turn."""

    model_config = ConfigDict(extra="forbid", strict=True)

    conversation_id: StrictStr | None = Field(
        default=None, min_length=1, max_length=MAX_IDENTIFIER_CHARS,
        description="conversation id (or header X-Cpmemory-Conversation)",
    )
    blocks: list[BlockIn] = Field(default_factory=list, max_length=MAX_BLOCKS)
    query: StrictStr | None = Field(default=None, max_length=MAX_TEXT_CHARS,
                                    description="the question (default: the last user message)")

    @field_validator("conversation_id", "query")
    @classmethod
    def _check_text(cls, value: str | None) -> str | None:
        return None if value is None else _encodable(value)


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string or a list of OpenAI content parts."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr = Field(max_length=64)
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """An OpenAI chat completion request, plus the optional ``cpmemory`` extension. Unknown fields pass through."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(max_length=1024)
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    stream: bool = False
    cpmemory: CpMemoryExtension | None = None


class EvictionReport(BaseModel):
    """Request ids the engine evicted (from engines patched to report them)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_ids: list[StrictStr] = Field(max_length=100_000)


class EvictionResult(BaseModel):
    """How many index leaves the report removed (unknown ids are ignored)."""

    evicted: int


class ErrorDetail(BaseModel):
    """A typed error, OpenAI style."""

    type: str
    code: str
    message: str
    param: str | None = None
    details: list[dict[str, Any]] | None = None


class ErrorBody(BaseModel):
    """Body of every error the proxy itself produces."""

    error: ErrorDetail


class BlockDecisionOut(BaseModel):
    """What cpmemory did with one block (original rank order)."""

    block_id: str
    label: str
    status: Status
    original_rank: int
    prompt_position: int | None
    saved_chars: int = 0
    duplicate_of: int | None = None


class TurnInfo(BaseModel):
    """The ``cpmemory`` field added to a chat response."""

    conversation_id: str
    turn: int | None
    request_id: str
    replica: int
    route_reason: str
    failovers: int
    decisions: list[BlockDecisionOut]
    cached_tokens: int
    prompt_tokens: int
    tokens_deduplicated: int
    degraded: bool
    committed: bool
    overhead_ms: float
    wait_ms: float = 0.0  # admission's waits by design (hold, cache fit): not in overhead_ms


class ReplicaHealth(BaseModel):
    """One replica in /healthz (no URL: the topology is not exposed)."""

    index: int
    healthy: bool
    in_flight: int


class HealthOut(BaseModel):
    """Body of /healthz."""

    status: Literal["ok", "degraded", "down"]
    replicas: list[ReplicaHealth]


class ReadyOut(BaseModel):
    """Body of /readyz: ready when at least one engine answers its health check now and the store serves a read."""

    ready: bool
    engines_reachable: int
    engines: int
    store: str
