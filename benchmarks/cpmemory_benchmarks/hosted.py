"""``cpmemory bench hosted``: what a hosted provider's prompt cache saves with cpmemory, under its documented rules.

The same conversations are sent twice to a local stand-in of the provider (cpmemory.testing.hosted_mock: OpenAI's
automatic cache or Anthropic's breakpoints, with their minimums, steps, lookback and lifetimes, on a simulated
clock): once as each framework's documentation builds the prompt ("plain"), once through cpmemory. Tokens are
counted by the deterministic offline tokenizer (cpmemory.bench.tokenizer); cost by cpmemory.hosted's price table.

- ``locomo_mem0``: LoCoMo's questions as chats with a Mem0 memory (the top BM25 dialog turns as its search results).
  Plain follows Mem0's chat examples: the memories written into the system message ("User Memories:"), then the
  history, then the question. cpmemory: the same search through ``mem0_cpmemory.CpMemoryMem0`` (memories in the
  turn's user message, de-duplicated against the conversation; history as sent).
- ``mt_rag``: MT-RAG's multi-turn conversations. Plain: the history (questions and answers) resent, the turn's
  passages in the last user message. cpmemory: ``CpMemory.prepare`` (history as sent, passages de-duplicated and
  ordered).

Both arms go through :class:`cpmemory.hosted.HostedProvider`: plain with the provider's default use (OpenAI: no
``prompt_cache_key``; Anthropic: breakpoints at the end of the system prompt and of the prompt, its multi-turn
example), cpmemory with its own (a key per conversation; system, history, context and prompt breakpoints).
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from cpmemory.bench.loaders import default_data_dir, interleave, load_locomo, load_mt_rag
from cpmemory.bench.report import json_line, progress_bar, stderr_console
from cpmemory.bench.tokenizer import count_tokens, tokenize_cached
from cpmemory.bench.trace import TraceRequest

PROVIDERS = ("openai", "anthropic")
WORKLOADS = ("locomo_mem0", "mt_rag")
DEFAULT_MODELS = {"openai": "gpt-5", "anthropic": "claude-sonnet-4-5"}
MEM0_INSTRUCTIONS = "You are a helpful AI. Answer the question based on query and memories."
RAG_SYSTEM = "You are a helpful assistant. Answer the question using the documents provided."
CONCURRENCY = 8
"""Conversations in flight at once (their turns interleave)."""
DEFAULT_BUDGET = 8192
"""locomo_mem0: the cpmemory arm's token budget. A LoCoMo chat runs to two hundred questions; cpmemory's history
keeps every memory it sent, so without a budget each turn re-reads it all (the cached reads then cost more than the
plain prompt: docs/results/hosted.md). Plain Mem0 keeps only the questions and answers."""
GAP_S = 5.0
"""Simulated seconds between two requests (a conversation's next turn comes ``CONCURRENCY`` requests later)."""


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: str
    query: str
    blocks: tuple[tuple[str, str], ...]
    answer: str


@dataclass(slots=True)
class Tally:
    """One arm's totals."""

    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    cost: float = 0.0
    max_breakpoints: int = 0
    lost_blocks: int = 0
    requests: int = 0
    largest_prompt: int = 0
    cost_uncached: float = 0.0

    def add(self, info: Mapping[str, Any], price: Any = None) -> None:
        self.requests += 1
        self.input_tokens += int(info["input_tokens"])
        self.largest_prompt = max(self.largest_prompt, int(info["input_tokens"]))
        self.cached_input_tokens += int(info["cached_input_tokens"])
        self.cache_write_tokens += int(info["cache_write_tokens"])
        self.cost += float(info["estimated_input_cost"] or 0.0)
        self.max_breakpoints = max(self.max_breakpoints, int(info.get("breakpoints", 0)))
        if price is not None:  # what the same prompt would cost with no cache at all
            self.cost_uncached += int(info["input_tokens"]) * price.input / 1e6

    def as_dict(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "cached_input_tokens": self.cached_input_tokens,
                "cache_write_tokens": self.cache_write_tokens, "cost": round(self.cost, 6),
                "max_breakpoints": self.max_breakpoints, "lost_blocks": self.lost_blocks,
                "requests": self.requests, "largest_prompt": self.largest_prompt,
                "cost_uncached": round(self.cost_uncached, 6)}


# ---------------------------------------------------------------------------------------------------- workloads

def _turns(requests: Sequence[TraceRequest], answers: Callable[[TraceRequest], str]) -> list[Turn]:
    return [Turn(request.session, request.query, tuple((block.id, block.text) for block in request.blocks),
                 answers(request)) for request in requests]


def locomo_mem0(data_dir: Path, turns: int | None) -> list[Turn]:
    """LoCoMo: one chat per conversation, its questions in order (the first ``turns``), interleaved."""
    samples = json.loads((data_dir / "locomo" / "locomo10.json").read_text(encoding="utf-8"))
    answer_of = {f"{sample['sample_id']}:q{index}": str(qa.get("answer", qa.get("adversarial_answer", "")))
                 for sample in samples for index, qa in enumerate(sample["qa"])}
    by_chat: dict[str, list[TraceRequest]] = defaultdict(list)
    for request in load_locomo(data_dir).requests:
        chat = request.session.split(":")[0]
        by_chat[chat].append(TraceRequest(chat, len(by_chat[chat]), request.query, request.blocks,
                                          answer=answer_of.get(request.session)))
    chats = [requests[:turns] for _, requests in sorted(by_chat.items())]
    return _turns(interleave(chats, CONCURRENCY), lambda request: request.answer or "I don't know.")


def mt_rag(data_dir: Path, turns: int | None) -> list[Turn]:
    """MT-RAG: its conversations (the first ``turns`` of each), interleaved."""
    by_chat: dict[str, list[TraceRequest]] = defaultdict(list)
    for request in load_mt_rag(data_dir).requests:
        by_chat[request.session].append(request)
    chats = [requests[:turns] for _, requests in sorted(by_chat.items())]
    return _turns(interleave(chats, CONCURRENCY), lambda request: request.answer or "I don't know.")


LOADERS: dict[str, Callable[[Path, int | None], list[Turn]]] = {"locomo_mem0": locomo_mem0, "mt_rag": mt_rag}


# -------------------------------------------------------------------------------------------------------- arms

class _Mem0Stub:
    """A Mem0 memory whose search returns the workload's retrieved memories for the current turn."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def search(self, query: str, **kwargs: Any) -> dict[str, Any]:
        return {"results": list(self.results)}


class Arm:
    """One way of sending: a provider stand-in, a clock, the chat client, the history kept per conversation."""

    def __init__(self, provider: str, model: str, cpmemory: bool, budget: int | None = None) -> None:
        import httpx

        from cpmemory import CpMemory, CpMemoryConfig
        from cpmemory.hosted import CONVERSATION_PLACEMENT, CPMEMORY_PLACEMENT, HostedChat, HostedSettings
        from cpmemory.testing.hosted_mock import AnthropicCacheMock, ManualClock, OpenAICacheMock

        self.clock = ManualClock()
        self.answer = ""
        mock_type = OpenAICacheMock if provider == "openai" else AnthropicCacheMock
        self.mock = mock_type(clock=self.clock, tokenize=tokenize_cached, answer=lambda body: self.answer)
        settings = HostedSettings(provider=provider, api_key="test-key", base_url="http://provider", model=model,
                                  prompt_cache_key=cpmemory,
                                  placement=CPMEMORY_PLACEMENT if cpmemory else CONVERSATION_PLACEMENT)
        memory = CpMemory(config=CpMemoryConfig(token_counter=count_tokens))  # budgets in the provider's tokens
        self.chat = HostedChat(settings, memory, http_client=httpx.Client(transport=self.mock.transport()))
        self.cpmemory = cpmemory
        self.history: dict[str, list[dict[str, str]]] = defaultdict(list)
        self.tally = Tally()
        self.mem0: Any = None
        self.budget = budget

    def send(self, workload: str, turn: Turn) -> None:
        self.answer = turn.answer
        if not self.cpmemory:
            info = self._plain(workload, turn)
        elif workload == "locomo_mem0":
            info = self._through_mem0(turn)
        else:
            info = self._through_facade(turn)
        self.tally.add(info, self.chat.provider.price(str(info["model"])))
        self.clock.advance(GAP_S)

    def _plain(self, workload: str, turn: Turn) -> dict[str, Any]:
        history = self.history[turn.conversation]
        if workload == "locomo_mem0":
            memories = "\n".join(f"- {text}" for _, text in turn.blocks)
            system = f"{MEM0_INSTRUCTIONS}\nUser Memories:\n{memories}"
            user = turn.query
        else:
            system = RAG_SYSTEM
            user = "\n\n".join(text for _, text in turn.blocks) + f"\n\nQuestion: {turn.query}"
        messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": user}]
        sent = self.chat.send(messages)
        # Mem0's examples keep the question, not the memories, in the history; a RAG chat keeps what it sent
        kept = turn.query if workload == "locomo_mem0" else user
        history += [{"role": "user", "content": kept}, {"role": "assistant", "content": sent.answer}]
        return sent.info

    def _through_facade(self, turn: Turn) -> dict[str, Any]:
        sent = self.chat.turn(turn.conversation, turn.query, list(turn.blocks))
        self._check(turn, sent.prepared.messages if sent.prepared is not None else [])
        return sent.info

    def _through_mem0(self, turn: Turn) -> dict[str, Any]:
        from mem0_cpmemory import CpMemoryMem0

        if self.mem0 is None:
            self.stub = _Mem0Stub()
            self.mem0 = CpMemoryMem0(self.stub, self.chat.memory, system_prompt=MEM0_INSTRUCTIONS,
                                     max_prompt_tokens=self.budget)
        self.stub.results = [{"id": ident, "memory": text, "score": 1.0 - rank / 100}
                             for rank, (ident, text) in enumerate(turn.blocks)]
        self.mem0.search(turn.query, user_id=turn.conversation, run_id=turn.conversation)
        messages = self.mem0.chat_messages(turn.conversation)
        self._check(turn, messages)
        sent = self.chat.send(messages, conversation_id=turn.conversation)
        self.mem0.commit(sent.answer, conversation_id=turn.conversation)
        return sent.info

    def _check(self, turn: Turn, messages: Sequence[Mapping[str, Any]]) -> None:
        from cpmemory.core.invariants import check_no_loss

        report = check_no_loss(list(turn.blocks), messages, check_order=False, query=turn.query)
        self.tally.lost_blocks += len(report.violations)


def run(provider: str, workload: str, turns: list[Turn], model: str, advance: Callable[[int], None],
        budget: int | None = None) -> dict[str, Any]:
    """Both arms over ``turns``; the workload's JSON entry."""
    arms = {"plain": Arm(provider, model, cpmemory=False),
            "cpmemory": Arm(provider, model, cpmemory=True, budget=budget)}
    for turn in turns:
        for arm in arms.values():
            arm.send(workload, turn)
        advance(1)
    plain, ours = arms["plain"].tally, arms["cpmemory"].tally
    return {"plain": plain.as_dict(), "cpmemory": ours.as_dict(),
            "cost_ratio": round(ours.cost / plain.cost, 4) if plain.cost else None,
            "conversations": len({turn.conversation for turn in turns}), "turns": len(turns)}


def _short(count: float) -> str:
    return f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count / 1e3:.0f}k" if count >= 1e3 else f"{count:.0f}"


def table(result: Mapping[str, Any]) -> Any:
    from rich.table import Table

    out = Table(title=f"bench hosted: {result['provider']} ({result['model']})")
    for column in ("workload", "arm", "input", "cached", "written", "cost", "ratio", "bp", "lost"):
        out.add_column(column, justify="left" if column in ("workload", "arm") else "right")
    for name, entry in result["workloads"].items():
        for arm in ("plain", "cpmemory"):
            tally = entry[arm]
            share = tally["cached_input_tokens"] / max(1, tally["input_tokens"])
            ratio = f"{entry['cost_ratio']:.3f}" if arm == "cpmemory" and entry["cost_ratio"] is not None else ""
            out.add_row(name, arm, _short(tally["input_tokens"]), f"{share:.0%}",
                        _short(tally["cache_write_tokens"]), f"{tally['cost']:.2f}", ratio,
                        str(tally["max_breakpoints"]), str(tally["lost_blocks"]))
    return out


def command(
    provider: str = typer.Option("openai", help="openai or anthropic (their documented cache rules)."),
    workload: list[str] = typer.Option(list(WORKLOADS), help="locomo_mem0 and/or mt_rag (repeat the option)."),
    model: str = typer.Option("", help="model whose prices apply (default: gpt-5 / claude-sonnet-4-5)."),
    turns: int = typer.Option(0, help="questions per conversation (0: all)."),
    max_prompt_tokens: int = typer.Option(
        DEFAULT_BUDGET, help="locomo_mem0: the cpmemory arm's prompt budget (CpMemoryMem0 max_prompt_tokens; 0: none)."),
    data_dir: Path = typer.Option(None, help="data root (default: ../shared/data)."),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of the table."),
) -> None:
    """Send the same conversations plain and through cpmemory to a local stand-in of the provider."""
    if provider not in PROVIDERS:
        raise typer.BadParameter(f"choose from {list(PROVIDERS)}", param_hint="--provider")
    unknown = [name for name in workload if name not in WORKLOADS]
    if unknown:
        raise typer.BadParameter(f"unknown {unknown}; choose from {list(WORKLOADS)}", param_hint="--workload")
    root = data_dir or default_data_dir()
    chosen_model = model or DEFAULT_MODELS[provider]
    loaded = {name: LOADERS[name](root, turns or None) for name in dict.fromkeys(workload)}
    result: dict[str, Any] = {"provider": provider, "model": chosen_model, "workloads": {}}
    with progress_bar(sum(len(items) for items in loaded.values()), f"bench hosted {provider}") as advance:
        for name, items in loaded.items():
            budget = (max_prompt_tokens or None) if name == "locomo_mem0" else None
            result["workloads"][name] = run(provider, name, items, chosen_model, advance, budget)
            result["workloads"][name]["cpmemory_prompt_budget"] = budget
    if as_json:
        print(json_line(result))
    else:
        stderr_console().print(table(result))
