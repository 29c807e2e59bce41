"""A multi-turn LangGraph RAG agent whose retrieval goes through cpmemory, offline (fake chat model).

    .venv/bin/python examples/langgraph_rag.py

The graph is ``retrieve -> answer`` with an ``InMemorySaver`` checkpointer: each ``thread_id`` is one conversation.
The retrieval node calls a :class:`~langchain_cpmemory.CpMemoryRetriever` wrapping a plain keyword retriever;
the answer node builds the prompt with cpmemory (a passage shown in an earlier turn becomes a one-line reference),
asks the chat model, and commits the answer. Per turn it prints each passage's status and the passage tokens sent
in full vs by reference. Every prompt fits a token budget (``BUDGET`` tokens, cpmemory's default counter, passed
through ``CpMemoryRetriever(max_prompt_tokens=...)``); the last line reports it and the largest prompt.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

PASSAGES = {
    "lyon": "Lyon is the third-largest city of France, where two rivers meet: the Rhone and the Saone.",
    "lyon-food": "Lyon is famous for its bouchons, small restaurants serving quenelles and saucisson.",
    "lyon-light": "Every December Lyon holds the Festival of Lights, when residents place candles in windows.",
    "paris": "Paris is the capital of France and is crossed by the Seine.",
    "paris-museum": "The Louvre in Paris is the most visited art museum in the world.",
    "rhone": "The Rhone rises in the Swiss Alps and flows through Lyon to the Mediterranean Sea.",
    "saone": "The Saone river joins the Rhone in Lyon after flowing south from the Vosges.",
    "alps": "Mont Blanc, on the border of France and Italy, is the highest peak of the Alps.",
}

QUESTIONS = [
    "Which rivers meet in Lyon?",
    "What food is Lyon known for?",
    "Where does the Rhone flow after Lyon?",
    "What happens in Lyon in December?",
]

BUDGET = 600
"""Token budget of every prompt (small, so that the history window restarts within the four turns)."""

ANSWERS = [
    "The Rhone and the Saone meet in Lyon.",
    "Bouchons serving quenelles and saucisson.",
    "South to the Mediterranean Sea.",
    "The Festival of Lights.",
]


def keyword_retriever(k: int = 3) -> Any:
    """A plain retriever ranking the passages by words shared with the question (stands in for a vector store)."""
    from langchain_core.callbacks import CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    def words(text: str) -> set[str]:
        return {word for word in re.findall(r"[a-z]+", text.lower()) if len(word) > 3}

    class KeywordRetriever(BaseRetriever):
        def _get_relevant_documents(
            self, query: str, *, run_manager: CallbackManagerForRetrieverRun
        ) -> list[Document]:
            scored = sorted(PASSAGES.items(), key=lambda item: (-len(words(item[1]) & words(query)), item[0]))
            return [Document(page_content=text, id=passage_id) for passage_id, text in scored[:k]]

    return KeywordRetriever()


def prompt_recorder() -> Any:
    """A LangChain callback handler keeping the messages of every chat model call."""
    from langchain_core.callbacks import BaseCallbackHandler

    class PromptRecorder(BaseCallbackHandler):
        def __init__(self) -> None:
            self.prompts: list[list[Any]] = []

        def on_chat_model_start(self, serialized: Any, messages: list[list[Any]], **kwargs: Any) -> None:
            self.prompts.extend(messages)

    return PromptRecorder()


def run(thread_id: str = "visitor-1", budget: int | None = BUDGET) -> dict[str, int]:
    """Run the conversation; print one block per turn; return the totals."""
    from langchain_core.language_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langgraph.checkpoint.memory import InMemorySaver

    from cpmemory.bench.tokenizer import count_tokens
    from cpmemory.facade import CpMemory
    from cpmemory.session.budget import MESSAGE_OVERHEAD_TOKENS, estimate_tokens
    from langchain_cpmemory import CpMemoryRetriever
    from langchain_cpmemory.graph import build_rag_graph

    retriever = CpMemoryRetriever(retriever=keyword_retriever(), memory=CpMemory(), max_prompt_tokens=budget)
    model = GenericFakeChatModel(messages=iter(AIMessage(content=answer) for answer in ANSWERS))
    graph = build_rag_graph(retriever, model, checkpointer=InMemorySaver())
    recorder = prompt_recorder()
    config = {"configurable": {"thread_id": thread_id}, "callbacks": [recorder]}
    totals = {"turns": 0, "tokens_full": 0, "tokens_referenced": 0, "prompt_tokens_max": 0, "over_budget": 0}
    for question in QUESTIONS:
        state = graph.invoke({"question": question}, config)
        print(f"\nQ{totals['turns'] + 1}: {question}\n    A: {state['messages'][-1].content}")
        for document in state["documents"]:
            decision = document.metadata["cpmemory"]
            tokens = count_tokens(document.page_content)
            key = "tokens_referenced" if decision["status"] == "referenced" else "tokens_full"
            totals[key] += tokens
            print(
                f"    {decision['status']:<10} {decision['label']}  rank {decision['original_rank']}  "
                f"{tokens:>3} tokens  {document.id}"
            )
        totals["turns"] += 1
        prompt = recorder.prompts[-1]
        size = sum(estimate_tokens(str(message.content)) + MESSAGE_OVERHEAD_TOKENS for message in prompt)
        totals["prompt_tokens_max"] = max(totals["prompt_tokens_max"], size)
        totals["over_budget"] += int(budget is not None and size > budget)
    print(
        f"\n{totals['turns']} turns, {len(state['messages'])} messages kept by the checkpointer for {thread_id!r}"
    )
    print(f"passage tokens: {totals['tokens_full']} sent in full, {totals['tokens_referenced']} by reference")
    print(
        f"token budget: {budget} per prompt (cpmemory's default counter); largest prompt "
        f"{totals['prompt_tokens_max']}, over budget {totals['over_budget']}"
    )
    print("\nthe last user message the model received:\n" + recorder.prompts[-1][-1].content)
    return totals


def main() -> int:
    """Entry point."""
    run()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    raise SystemExit(main())
