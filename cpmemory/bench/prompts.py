"""The prompts a replayed trace sends: each request's blocks, its user message, its chat prompt's tokens.

Every strategy writes the same system prompt, block format (``cpmemory.core.annotations``), order annotation (when
the prompt order differs from the relevance order) and question; multi-turn sessions carry their history (each
earlier turn's user message as sent, then its answer) as the prompt prefix. :class:`FacadePromptBuilder` builds them
through the product (``CpMemory.prepare`` then ``commit``: de-duplication and reference annotations);
:class:`PlainPromptBuilder` never de-duplicates. ``cpmemory demo``, ``cpmemory bench serve`` and the research replay
(``benchmarks/``) all build their prompts here.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpmemory.bench import tokenizer
from cpmemory.bench.trace import Trace, TraceRequest
from cpmemory.core import annotations as prompt_format
from cpmemory.core.blocks import Block, content_hash
from cpmemory.errors import InvalidInputError

_ANNOTATION_LINE = re.compile(
    r"^(?:\[D[0-9a-f]{7,32}\]" + re.escape(prompt_format.REFERENCE_SUFFIX) + r"|"
    + re.escape(prompt_format.ORDER_PREFIX) + r".*|\(Rest of \[D[0-9a-f]{7,32}\].*)$", re.MULTILINE)
_SECTION_START = re.compile(r"(?=\n\[)")


def message_tokens(text: str) -> list[int]:
    """Token ids of ``text``, equal to ``tokenize(text)``, memoised per block section.

    The text is cut before every ``"\\n["`` (a block header or labelled line starts there). The tokenizer never
    makes a piece across that point (a newline followed by ``[`` ends a whitespace piece; ``[`` starts a
    punctuation piece), so the pieces are the same, and each section (a block as rendered) is tokenized once for
    the whole replay instead of once per prompt. The replay's tests check the equality.
    """
    tokens: list[int] = []
    for part in _SECTION_START.split(text):
        tokens.extend(tokenizer.tokenize_cached(part))
    return tokens


def count_message_tokens(text: str) -> int:
    """``len(tokenize(text))`` through :func:`message_tokens`' memoised sections."""
    return sum(len(tokenizer.tokenize_cached(part)) for part in _SECTION_START.split(text))


def chat_tokens(messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the rendered chat prompt, equal to ``tokenizer.tokenize_chat(messages)``."""
    tokens: list[int] = []
    for message in messages:
        tokens.extend(message_tokens(
            f"{tokenizer.CHAT_START}{message['role']}\n{message['content']}{tokenizer.CHAT_END}\n"))
    tokens.extend(tokenizer.tokenize_cached(f"{tokenizer.CHAT_START}assistant\n"))
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
    return sum(tokenizer.count_tokens(match.group()) for match in _ANNOTATION_LINE.finditer(text))


def plain_user_message(blocks: Sequence[Block], order: Sequence[int], query: str) -> str:
    """The user message with every block in full in ``order`` (order annotation when it differs from relevance)."""
    labels = [block.label for block in blocks]
    sections = [prompt_format.format_block(labels[i], blocks[i].text) for i in order]
    appearance = [labels[i] for i in order]
    return prompt_format.build_user_message(
        sections, [], labels if appearance != labels else None, query, appearance
    )


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

    def _conversation(self, request: TraceRequest) -> str:
        conversation = request.session if self.multi_turn else f"{request.session}#{self._count}"
        self._count += 1
        return conversation

    def build(self, request: TraceRequest, prepared: PreparedRequest, context: Sequence[str]) -> dict[str, Any]:
        """Prepare and commit the turn; return its messages, the content tokens dedup removed, annotation tokens."""
        position = {key: i for i, key in enumerate(prepared.keys)}
        order = [position[key] for key in context]
        turn = self.memory.prepare(self._conversation(request), request.query, prepared.blocks,
                                   prompt_order=[prepared.blocks[i].id for i in order])
        self.memory.commit(turn, answer_of(request))
        return _figures(turn.messages, prepared, order, request.query)

    def build_online(self, request: TraceRequest, prepared: PreparedRequest) -> dict[str, Any]:
        """Like :meth:`build` with no ``prompt_order``: the facade's online ordering decides (the integrations' path).

        ``middleware_ms`` is then the time of ``prepare`` + ``commit`` alone (not this benchmark's token counting).
        """
        conversation = self._conversation(request)
        started = time.perf_counter()
        turn = self.memory.prepare(conversation, request.query, prepared.blocks)
        self.memory.commit(turn, answer_of(request))
        self.middleware_ms = (time.perf_counter() - started) * 1000.0
        position = {block.id: i for i, block in enumerate(prepared.blocks)}
        order = [position[block_id] for block_id in turn.prompt_order]
        order += [i for i in range(len(prepared.blocks)) if i not in set(order)]
        return _figures(turn.messages, prepared, order, request.query)


def _figures(messages: list[dict[str, str]], prepared: PreparedRequest, order: Sequence[int],
             query: str) -> dict[str, Any]:
    """The built turn's messages, the content tokens de-duplication removed, and the annotation tokens it added."""
    user = messages[-1]["content"]
    plain = plain_user_message(prepared.blocks, order, query)
    added = annotation_tokens(user)
    saved = (count_message_tokens(plain) - annotation_tokens(plain)) - (count_message_tokens(user) - added)
    return {"messages": messages, "dedup_saved": max(0, saved), "annotation": added}


def load_trace(trace_file: Path | None, workload: str | None, data_dir: Path | None, skip_bad: bool,
               multi_turn: bool | None) -> Trace:
    """The trace of ``--trace FILE`` or of ``--workload NAME`` (exactly one).

    Raises:
        InvalidInputError: both or neither given, or a bad trace or workload.
    """
    from cpmemory.bench.loaders import load_workload
    from cpmemory.bench.trace import read_trace

    if trace_file is not None and workload is None:
        return read_trace(trace_file, skip_bad=skip_bad, multi_turn=multi_turn)
    if workload is not None and trace_file is None:
        return load_workload(workload, data_dir)
    raise InvalidInputError("give exactly one of --trace FILE or --workload NAME")
