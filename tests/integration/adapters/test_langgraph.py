"""A LangGraph agent graph (InMemorySaver checkpointer, thread_id) whose retrieval goes through cpmemory."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langgraph")

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.vectorstores import InMemoryVectorStore
from langgraph.checkpoint.memory import InMemorySaver

from cpmemory.core.blocks import Block
from cpmemory.core.invariants import check_no_loss
from cpmemory.facade import AsyncCpMemory, CpMemory
from langchain_cpmemory import CpMemoryRetriever, PassthroughWarning, relevance_order
from langchain_cpmemory.graph import build_rag_graph

TEXTS = [
    f"Fact {i}: the {word} is stored in room {i}."
    for i, word in enumerate(
        ["atlas", "globe", "compass", "sextant", "telescope", "map", "chart", "astrolabe"]
    )
]


class PromptRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.prompts: list[list[BaseMessage]] = []

    def on_chat_model_start(self, serialized: Any, messages: list[list[BaseMessage]], **kwargs: Any) -> None:
        self.prompts.extend(messages)


def _graph(memory: Any, answers: list[str], *, checkpointer: Any = None) -> tuple[Any, CpMemoryRetriever]:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=text, id=f"f{i}") for i, text in enumerate(TEXTS)])
    retriever = CpMemoryRetriever(retriever=store.as_retriever(search_kwargs={"k": 4}), memory=memory)
    model = GenericFakeChatModel(messages=iter(AIMessage(content=answer) for answer in answers))
    return build_rag_graph(retriever, model, checkpointer=checkpointer), retriever


def _check(documents: list[Document], prompt: list[BaseMessage]) -> None:
    blocks = [Block(str(rank), d.page_content) for rank, d in enumerate(relevance_order(documents))]
    messages = [
        {"role": {"human": "user", "ai": "assistant"}.get(m.type, m.type), "content": m.content}
        for m in prompt
    ]
    report = check_no_loss(blocks, messages)
    assert report.ok, report.violations


def test_multi_turn_graph_with_checkpointer() -> None:
    graph, retriever = _graph(CpMemory(), ["one", "two", "three"], checkpointer=InMemorySaver())
    recorder = PromptRecorder()
    config = {"configurable": {"thread_id": "user-1"}, "callbacks": [recorder]}
    questions = ["Where is the atlas?", "Where is the globe?", "Where is the atlas?"]
    states = [graph.invoke({"question": question}, config) for question in questions]
    assert [m.content for m in states[-1]["messages"]] == [
        questions[0],
        "one",
        questions[1],
        "two",
        questions[2],
        "three",
    ]
    for state, prompt in zip(states, recorder.prompts):
        _check(state["documents"], prompt)
    third = states[-1]["documents"]
    assert {d.metadata["cpmemory"]["turn"] for d in third} == {3}
    seen_before = {d.id for state in states[:2] for d in state["documents"]}
    for document in third:
        assert document.metadata["cpmemory"]["status"] == (
            "referenced" if document.id in seen_before else "new"
        )
    assert recorder.prompts[2][: len(recorder.prompts[1])] == recorder.prompts[1]  # prefix-stable
    assert len(retriever.pending) == 0


def test_threads_are_separate_conversations() -> None:
    graph, _ = _graph(CpMemory(), ["a", "b"], checkpointer=InMemorySaver())
    first = graph.invoke({"question": "atlas"}, {"configurable": {"thread_id": "t-a"}})
    other = graph.invoke({"question": "atlas"}, {"configurable": {"thread_id": "t-b"}})
    assert {d.metadata["cpmemory"]["status"] for d in first["documents"]} == {"new"}
    assert {d.metadata["cpmemory"]["status"] for d in other["documents"]} == {"new"}
    assert len(other["messages"]) == 2


def test_graph_without_thread_id_passes_through() -> None:
    graph, _ = _graph(CpMemory(), ["plain"])
    recorder = PromptRecorder()
    with pytest.warns(PassthroughWarning):
        state = graph.invoke({"question": "compass"}, {"callbacks": [recorder]})
    assert {d.metadata["cpmemory"]["status"] for d in state["documents"]} == {"passthrough"}
    assert all(d.page_content in recorder.prompts[0][-1].content for d in state["documents"])
    assert state["messages"][-1].content == "plain"


async def test_async_graph() -> None:
    graph, retriever = _graph(AsyncCpMemory(), ["x", "y"], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "async-1"}}
    await graph.ainvoke({"question": "sextant"}, config)
    state = await graph.ainvoke({"question": "sextant"}, config)
    assert {d.metadata["cpmemory"]["status"] for d in state["documents"]} == {"referenced"}
    assert [m.content for m in state["messages"]] == ["sextant", "x", "sextant", "y"]
    assert len(retriever.pending) == 0


def test_failed_model_call_aborts_the_turn() -> None:
    graph, retriever = _graph(CpMemory(), ["only one answer"], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "fail-1"}}
    graph.invoke({"question": "map"}, config)
    with pytest.raises(RuntimeError):  # the fake model has no second answer: a failed LLM call
        graph.invoke({"question": "chart"}, config)
    assert len(retriever.pending) == 0
    assert retriever.memory.counters.snapshot()["aborts"] == 1


def test_retriever_inside_a_node_picks_up_the_thread_id_without_config() -> None:
    from langgraph.graph import END, START, StateGraph

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=text, id=f"f{i}") for i, text in enumerate(TEXTS)])
    retriever = CpMemoryRetriever(retriever=store.as_retriever(search_kwargs={"k": 3}), memory=CpMemory())

    def my_node(state: dict[str, Any]) -> dict[str, Any]:  # a user's own node: no config parameter
        return {"documents": retriever.invoke(state["question"])}

    builder: Any = StateGraph(dict)
    builder.add_node("mine", my_node)
    builder.add_edge(START, "mine")
    builder.add_edge("mine", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    state = graph.invoke({"question": "globe"}, {"configurable": {"thread_id": "implicit"}})
    assert {d.metadata["cpmemory"]["conversation_id"] for d in state["documents"]} == {"implicit"}
    assert retriever.pending.get("implicit") is not None
