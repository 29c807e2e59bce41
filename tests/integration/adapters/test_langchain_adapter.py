"""The LangChain retriever wrapper and prompt Runnable with real langchain-core objects and fake chat models."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.language_models import FakeListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from pydantic import Field

from cpmemory.core.blocks import Block
from cpmemory.core.invariants import check_no_loss
from cpmemory.errors import InvalidInputError, MissingDependencyError
from cpmemory.facade import AsyncCpMemory, CpMemory
from langchain_cpmemory import (
    CpMemoryPromptRunnable,
    CpMemoryRetriever,
    PassthroughWarning,
    relevance_order,
)

TEXTS = [
    "The Eiffel Tower is 330 metres tall.",
    "Paris is the capital of France.",
    "The Louvre is the most visited museum in the world.",
    "Lyon is known for its cuisine.",
    "The Seine flows through Paris.",
    "Mont Blanc is the highest mountain in the Alps.",
]


def _thread(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


def _store() -> InMemoryVectorStore:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=text, id=f"doc-{i}") for i, text in enumerate(TEXTS)])
    return store


def _retriever(k: int = 3, memory: Any = None) -> CpMemoryRetriever:
    return CpMemoryRetriever(
        retriever=_store().as_retriever(search_kwargs={"k": k}), memory=memory or CpMemory()
    )


def _blocks(documents: list[Document]) -> list[Block]:
    ordered = relevance_order(documents)
    return [Block(str(rank), d.page_content) for rank, d in enumerate(ordered) if d.page_content.strip()]


def _dicts(messages: list[BaseMessage]) -> list[dict[str, str]]:
    roles = {"human": "user", "ai": "assistant", "system": "system"}
    return [{"role": roles[m.type], "content": m.content} for m in messages]  # type: ignore[misc]


class PromptRecorder(BaseCallbackHandler):
    """Records the messages every chat model call receives (LangChain's own callback mechanism)."""

    def __init__(self) -> None:
        self.prompts: list[list[BaseMessage]] = []

    def on_chat_model_start(self, serialized: Any, messages: list[list[BaseMessage]], **kwargs: Any) -> None:
        self.prompts.extend(messages)


def test_retriever_reorders_without_losing_or_mutating_documents() -> None:
    retriever = _retriever(k=4)
    inner = retriever.retriever.invoke("Paris")
    before = [d.model_copy(deep=True) for d in inner]
    documents = retriever.invoke("Paris", _thread("t1"))
    assert sorted(d.id for d in documents) == sorted(d.id for d in inner)
    assert [d.id for d in relevance_order(documents)] == [d.id for d in inner]
    assert all(d.metadata["cpmemory"]["status"] == "new" for d in documents)
    assert [d.metadata["cpmemory"]["prompt_position"] for d in documents] == [0, 1, 2, 3]
    assert inner == before and all("cpmemory" not in d.metadata for d in retriever.retriever.invoke("Paris"))
    messages = retriever.prompt().invoke({"documents": documents, "question": "Paris"}, _thread("t1"))
    assert isinstance(messages[0], SystemMessage) and isinstance(messages[-1], HumanMessage)
    assert check_no_loss(_blocks(documents), _dicts(messages)).ok


def test_second_turn_references_documents_already_shown() -> None:
    retriever = _retriever(k=3)
    first = retriever.invoke("Paris", _thread("t2"))
    retriever.commit("Paris is the capital.", _thread("t2"))
    second = retriever.invoke("Paris museums", _thread("t2"))
    shown = {d.id for d in first}
    for document in second:
        expected = "referenced" if document.id in shown else "new"
        assert document.metadata["cpmemory"]["status"] == expected
    messages = retriever.prompt().invoke({"documents": second, "question": "Paris museums"}, _thread("t2"))
    assert check_no_loss(_blocks(second), _dicts(messages)).ok
    assert isinstance(messages[-2], AIMessage) and messages[-2].content == "Paris is the capital."


async def test_async_path_with_sync_and_async_facades() -> None:
    for memory in (CpMemory(), AsyncCpMemory()):
        retriever = _retriever(k=3, memory=memory)
        first = await retriever.ainvoke("Alps", _thread("a1"))
        assert {d.metadata["cpmemory"]["status"] for d in first} == {"new"}
        await retriever.acommit("Mont Blanc.", _thread("a1"))
        second = await retriever.ainvoke("Alps", _thread("a1"))
        assert {d.metadata["cpmemory"]["status"] for d in second} == {"referenced"}
        messages = await retriever.prompt().ainvoke({"documents": second, "question": "Alps"}, _thread("a1"))
        assert check_no_loss(_blocks(second), _dicts(messages)).ok
        assert await retriever.aabort(_thread("a1")) is True


def test_async_facade_on_the_sync_path_is_a_clear_error() -> None:
    retriever = _retriever(memory=AsyncCpMemory())
    with pytest.raises(InvalidInputError, match="ainvoke"):
        retriever.invoke("Paris", _thread("x"))


def test_without_thread_id_documents_pass_through_with_a_warning() -> None:
    retriever = _retriever(k=4)
    inner = retriever.retriever.invoke("Seine")
    with pytest.warns(PassthroughWarning):
        documents = retriever.invoke("Seine")
    assert sorted(d.id for d in documents) == sorted(d.id for d in inner)  # the same documents, ordered online
    assert {d.metadata["cpmemory"]["status"] for d in documents} == {"passthrough"}
    with pytest.warns(PassthroughWarning):
        again = retriever.invoke("Seine")  # the tenant's index learned the order sent: a repeat shares it whole
    assert [d.id for d in again] == [d.id for d in documents]
    with pytest.warns(PassthroughWarning):
        messages = retriever.prompt().invoke({"documents": documents, "question": "Seine"})
    assert all(d.page_content in messages[-1].content for d in documents)
    assert retriever.commit("no conversation") == 0


def test_explicit_conversation_key() -> None:
    retriever = CpMemoryRetriever(
        retriever=_store().as_retriever(search_kwargs={"k": 2}), memory=CpMemory(), conversation_key="session"
    )
    documents = retriever.invoke("Lyon", {"configurable": {"session": "s-9", "thread_id": "ignored"}})
    assert {d.metadata["cpmemory"]["conversation_id"] for d in documents} == {"s-9"}


class EmptyRetriever(BaseRetriever):
    """A retriever that finds nothing."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return []


def test_retriever_returning_no_documents() -> None:
    retriever = CpMemoryRetriever(retriever=EmptyRetriever(), memory=CpMemory())
    assert retriever.invoke("anything", _thread("e")) == []
    messages = retriever.prompt().invoke({"documents": [], "question": "anything"}, _thread("e"))
    assert messages[-1].content.endswith("anything")
    assert retriever.commit(AIMessage(content="I found nothing."), _thread("e")) == 1


def test_lcel_chain_gets_prefix_stable_prompts_and_commits() -> None:
    retriever = _retriever(k=3)
    recorder = PromptRecorder()
    model = FakeListChatModel(responses=["answer one", "answer two"])
    chain = {"documents": retriever, "question": RunnablePassthrough()} | retriever.prompt() | model
    chain = chain | retriever.committer()
    config = {**_thread("lcel"), "callbacks": [recorder]}
    assert chain.invoke("Eiffel Tower", config).content == "answer one"
    assert chain.invoke("Eiffel Tower", config).content == "answer two"
    first, second = recorder.prompts
    assert second[: len(first)] == first  # the second prompt extends the first: its prefix is cached
    assert "is shown earlier in this conversation" in second[-1].content
    assert second[-2].content == "answer one"
    assert len(retriever.pending) == 0  # both turns committed


def test_prompt_runnable_with_given_history_refers_only_to_text_in_it() -> None:
    prompt = CpMemoryPromptRunnable(CpMemory())
    documents = [Document(page_content=text, id=f"d{i}") for i, text in enumerate(TEXTS[:3])]
    prompt.invoke({"documents": documents, "question": "q1"}, _thread("h"))
    prompt.commit("a1", _thread("h"))
    history = [HumanMessage(content="unrelated"), AIMessage(content="ok")]
    messages = prompt.invoke({"documents": documents, "question": "q2", "history": history}, _thread("h"))
    assert messages[-3:-1] == history
    assert all(text in messages[-1].content for text in TEXTS[:3])  # not in the given history: sent again
    assert check_no_loss(_blocks(documents), _dicts(messages)).ok


def test_prompt_input_is_validated() -> None:
    prompt = CpMemoryPromptRunnable(CpMemory())
    for bad in (
        "text",
        {"documents": []},
        {"question": "q", "documents": "doc"},
        {"question": "q", "documents": [1]},
    ):
        with pytest.raises(InvalidInputError):
            prompt.invoke(bad, _thread("v"))


_ids = st.one_of(st.none(), st.sampled_from(["a", "b", "c"]))
_texts = st.sampled_from(["alpha", "beta", "gamma beta", "", " ", "delta"])
_docs = st.lists(st.tuples(_ids, _texts), max_size=6)


class ListRetriever(BaseRetriever):
    """Returns whatever list it currently holds."""

    documents: list[Document] = Field(default_factory=list)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return list(self.documents)


@settings(max_examples=80, deadline=None)
@given(turns=st.lists(_docs, min_size=1, max_size=3))
def test_no_document_is_ever_lost(turns: list[list[tuple[str | None, str]]]) -> None:
    inner = ListRetriever()
    retriever = CpMemoryRetriever(retriever=inner, memory=CpMemory())
    for entries in turns:
        inner.documents = [Document(page_content=text, id=doc_id) for doc_id, text in entries]
        out = retriever.invoke("q", _thread("prop"))
        assert sorted((d.id or "", d.page_content) for d in out) == sorted((i or "", t) for i, t in entries)
        messages = retriever.prompt().invoke({"documents": out, "question": "q"}, _thread("prop"))
        assert check_no_loss(_blocks(out), _dicts(messages)).ok
        retriever.commit("answer", _thread("prop"))


def test_import_without_langchain_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        n for n in sys.modules if n == "langchain_cpmemory" or n.startswith("langchain_cpmemory.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "langchain_core", None)
    with pytest.raises(MissingDependencyError, match="integrations/langchain-cpmemory"):
        importlib.import_module("langchain_cpmemory")


def test_passthrough_prompt_uses_the_facades_system_prompt() -> None:
    memory = CpMemory()
    with pytest.warns(PassthroughWarning):
        messages = CpMemoryPromptRunnable(memory).invoke({"documents": [], "question": "q"})
    assert isinstance(messages[0], SystemMessage) and messages[0].content == memory.config.system_prompt


def test_budget_passes_through_retriever_and_prompt_runnable() -> None:
    from cpmemory.session.budget import estimate_tokens

    retriever = CpMemoryRetriever(
        retriever=_store().as_retriever(search_kwargs={"k": 3}), memory=CpMemory(), max_prompt_tokens=300
    )
    sizes = []
    for turn in range(6):
        documents = retriever.invoke(f"Paris question {turn}", _thread("budget"))
        turn_prepared = retriever.pending.get("budget")
        assert turn_prepared.budget == 300
        sizes.append(sum(estimate_tokens(m["content"]) + 8 for m in turn_prepared.messages))
        assert check_no_loss(_blocks(documents), turn_prepared.messages).ok
        retriever.commit("An answer about Paris and its river.", _thread("budget"))
    assert max(sizes) <= 300
    prompt = retriever.prompt()
    assert prompt.max_prompt_tokens == 300
    given = [HumanMessage(content="earlier " * 200), AIMessage(content="ok")]
    messages = prompt.invoke({"documents": documents, "question": "q", "history": given}, _thread("budget"))
    assert sum(estimate_tokens(str(m.content)) + 8 for m in messages) <= 300
