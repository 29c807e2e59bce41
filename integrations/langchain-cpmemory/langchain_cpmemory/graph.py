"""LangGraph helpers: a retrieval node and an answer node that go through cpmemory, and a ready RAG graph.

    graph = build_rag_graph(retriever, chat_model, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "chat-42"}}
    graph.invoke({"question": "Where does Alice live?"}, config)

The graph's ``messages`` (kept by the checkpointer per ``thread_id``) hold the plain questions and answers for
the application; the prompt sent to the model is cpmemory's, built from the conversation's stored transcript, so
a document shown in an earlier turn is referenced instead of sent again. Needs the ``langgraph`` extra (``pip install -e . -e 'integrations/langchain-cpmemory[langgraph]'`` from a checkout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypedDict

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda

from langchain_cpmemory.prompt import CpMemoryPromptRunnable
from langchain_cpmemory.retriever import CpMemoryRetriever


def _add_messages(left: list[AnyMessage], right: list[AnyMessage]) -> list[AnyMessage]:
    from langgraph.graph.message import add_messages

    return add_messages(left, right)  # type: ignore[return-value]


class RagState(TypedDict, total=False):
    """State of :func:`build_rag_graph`: the question of the turn, its documents, the conversation so far."""

    question: str
    documents: list[Document]
    messages: Annotated[list[AnyMessage], _add_messages]


def retrieval_node(retriever: CpMemoryRetriever, *, question_key: str = "question") -> RunnableLambda:
    """Return a node that retrieves the state's question through ``retriever`` into ``state["documents"]``."""

    def retrieve(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        return {"documents": retriever.invoke(state[question_key], config)}

    async def aretrieve(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        return {"documents": await retriever.ainvoke(state[question_key], config)}

    return RunnableLambda(retrieve, afunc=aretrieve, name="cpmemory_retrieve")


def answer_node(
    model: BaseChatModel, prompt: CpMemoryPromptRunnable, *, question_key: str = "question"
) -> RunnableLambda:
    """Return a node that builds the turn's messages, asks ``model``, commits the answer, and appends Q and A.

    When the model call fails the turn is aborted (nothing recorded) and the error propagates.
    """

    def answer(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        question = state[question_key]
        messages = prompt.invoke({"documents": state.get("documents") or [], "question": question}, config)
        try:
            reply = model.invoke(messages, config)
        except BaseException:
            prompt.abort(config)
            raise
        prompt.commit(reply, config)
        return {"messages": [HumanMessage(content=question), reply]}

    async def aanswer(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        question = state[question_key]
        messages = await prompt.ainvoke(
            {"documents": state.get("documents") or [], "question": question}, config
        )
        try:
            reply = await model.ainvoke(messages, config)
        except BaseException:
            await prompt.aabort(config)
            raise
        await prompt.acommit(reply, config)
        return {"messages": [HumanMessage(content=question), reply]}

    return RunnableLambda(answer, afunc=aanswer, name="cpmemory_answer")


def build_rag_graph(retriever: CpMemoryRetriever, model: BaseChatModel, *, checkpointer: Any = None) -> Any:
    """Return a compiled ``retrieve -> answer`` LangGraph graph whose retrieval goes through cpmemory.

    Args:
        retriever: the cpmemory retriever (its ``prompt()`` builds the answer node's messages).
        model: any LangChain chat model.
        checkpointer: a LangGraph checkpointer (e.g. ``InMemorySaver()``) keeping ``messages`` per thread_id.
    """
    from langgraph.graph import END, START, StateGraph

    builder: Any = StateGraph(RagState)
    builder.add_node("retrieve", retrieval_node(retriever))
    builder.add_node("answer", answer_node(model, retriever.prompt()))
    builder.add_edge(START, "retrieve")
    builder.add_edge("retrieve", "answer")
    builder.add_edge("answer", END)
    return builder.compile(checkpointer=checkpointer)


NodeFunction = Callable[[dict[str, Any], RunnableConfig], dict[str, Any]]
