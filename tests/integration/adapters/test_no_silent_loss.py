"""Issue 16 reproducers through the adapters (a canned in-process Mem0, real langchain-core objects)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("mem0")

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage, convert_to_openai_messages
from langchain_core.retrievers import BaseRetriever
from pydantic import Field

from cpmemory.core.invariants import check_no_loss
from cpmemory.errors import InvalidInputError, StoreUnavailableError, UnknownReservationError
from cpmemory.facade import CpMemory
from cpmemory.stores.base import ConversationKey
from cpmemory.stores.memory import InMemorySessionStore
from langchain_cpmemory import CpMemoryPromptRunnable, CpMemoryRetriever, relevance_order
from langchain_cpmemory.documents import documents_to_blocks, same_documents
from mem0_cpmemory import CpMemoryMem0
from tests.integration.adapters.test_langchain_adapter import _retriever, _thread
from tests.no_loss_cases import SHARED_SENTENCE_FIRST


class CannedMem0:
    """Answers every search with a fixed payload."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def search(self, query: str, **kwargs: Any) -> Any:
        return self.payload


class FlakyStore(InMemorySessionStore):
    """Fails the next ``fail_commits`` commits as if Redis were down."""

    fail_commits = 0

    def commit(self, key, reservation_id, record):  # type: ignore[no-untyped-def]
        if self.fail_commits:
            self.fail_commits -= 1
            raise StoreUnavailableError("down")
        return super().commit(key, reservation_id, record)


def _open_reservations(memory: CpMemory, conversation: str) -> int:
    return len(memory.store._conversations[ConversationKey("default", conversation)].reservations)


def test_item2_mem0_renamed_ids_never_collide() -> None:
    items = [{"id": "a", "memory": "First memory."}, {"id": "a#2", "memory": "Second memory."},
             {"id": "a", "memory": "Third memory."}]
    wrapper = CpMemoryMem0(CannedMem0({"results": items}), CpMemory())
    found = wrapper.search("q", conversation_id="c")["results"]
    statuses = {item["memory"]: item["cpmemory"]["status"] for item in found}
    assert statuses == dict.fromkeys(statuses, "new")
    ids = {item["cpmemory"]["label"] for item in found}
    assert len(ids) == 3
    messages = wrapper.chat_messages("c")
    assert check_no_loss([(item["id"], item["memory"]) for item in items], messages).ok


def test_item2_langchain_chunks_sharing_an_id_all_reach_the_prompt() -> None:
    memory = CpMemory()
    prompt = CpMemoryPromptRunnable(memory)
    docs = [Document(page_content=f"Chunk {i} of the same file.", metadata={"id": "file"}) for i in range(3)]
    docs.append(Document(page_content="Another.", metadata={"id": "file#2"}))
    messages = prompt.invoke({"documents": docs, "question": "q"}, _thread("t"))
    sent = convert_to_openai_messages(messages)
    assert check_no_loss([("file", d.page_content) for d in docs], sent).ok


def test_item3_prompt_builds_from_the_documents_it_is_given() -> None:
    retriever = _retriever(k=2)
    config = _thread("t3")
    docs = retriever.invoke("Paris", config)
    compressed = docs[0].model_copy(update={"page_content": "Paris (compressed)."})
    prompt = retriever.prompt()
    messages = prompt.invoke({"documents": [compressed], "question": "Paris"}, config)
    text = messages[-1].content
    assert "Paris (compressed)." in text and docs[1].page_content not in text
    assert check_no_loss([("d", "Paris (compressed).")], convert_to_openai_messages(messages)).ok
    sent = prompt.sent_documents(config)  # metadata reports what was actually sent
    assert [d.page_content for d in sent] == ["Paris (compressed)."]
    turn = retriever.pending.get("t3")
    assert sent[0].metadata["cpmemory"]["reservation_id"] == turn.reservation_id
    assert sent[0].metadata["cpmemory"]["status"] == "new"
    assert retriever.commit("answer", config) == 1


def test_item3_the_same_documents_in_any_order_reuse_the_retrievers_turn() -> None:
    retriever = _retriever(k=3)
    config = _thread("t3b")
    docs = retriever.invoke("Paris", config)
    turn = retriever.pending.get("t3b")
    messages = retriever.prompt().invoke({"documents": list(reversed(docs)), "question": "Paris"}, config)
    assert retriever.pending.get("t3b") is turn
    assert messages[-1].content == turn.messages[-1]["content"]


class ListRetriever(BaseRetriever):
    """Returns the documents it holds, whatever the query."""

    documents: list[Document] = Field(default_factory=list)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return list(self.documents)


HARBOR = "The harbor opens at nine."
REPEATED = [("a", SHARED_SENTENCE_FIRST), ("b", HARBOR), ("a", SHARED_SENTENCE_FIRST)]
"""A text under id ``a`` twice (the property suite's example): dropping the first makes it rank after ``b``."""


def _documents(pairs: list[tuple[str, str]]) -> list[Document]:
    return [Document(page_content=text, metadata={"id": key}) for key, text in pairs]


def test_same_documents_needs_the_same_relevance_order() -> None:
    retriever = CpMemoryRetriever(retriever=ListRetriever(documents=_documents(REPEATED)), memory=CpMemory())
    returned = retriever.invoke("q", _thread("rank"))
    turn = retriever.pending.get("rank")
    same = documents_to_blocks(relevance_order(list(reversed(returned))))
    assert same_documents(same, turn)  # the documents in any order: the same blocks in the same relevance order
    first_dropped = [d for d in returned if d.metadata["cpmemory"]["original_rank"] != 0]
    moved = documents_to_blocks(relevance_order(first_dropped))
    assert sorted(b.id for b in moved.blocks) == sorted(d.block_id for d in turn.decisions)  # the same set ...
    assert not same_documents(moved, turn)  # ... in another relevance order: another prompt


def test_item3_dropping_the_first_of_a_repeated_document_keeps_the_relevance_order() -> None:
    retriever = CpMemoryRetriever(retriever=ListRetriever(documents=_documents(REPEATED)), memory=CpMemory())
    config = _thread("drop")
    returned = retriever.invoke("q", config)
    retrievers_turn = retriever.pending.get("drop")
    given = [d for d in returned if d.metadata["cpmemory"]["original_rank"] != 0]
    prompt = retriever.prompt()
    sent = convert_to_openai_messages(prompt.invoke({"documents": given, "question": "q"}, config))
    assert retriever.pending.get("drop") is not retrievers_turn  # prepared for these documents
    blocks = [("b", HARBOR), ("a", SHARED_SENTENCE_FIRST)]
    report = check_no_loss(blocks, sent, query="q")
    assert report.ok, report.violations
    text = sent[-1]["content"]
    assert text.index(HARBOR) < text.index(SHARED_SENTENCE_FIRST) or "Relevance order:" in text
    assert [d.page_content for d in relevance_order(prompt.sent_documents(config))] == [HARBOR, SHARED_SENTENCE_FIRST]
    assert retriever.commit("answer", config) == 1


def test_item3_a_reused_turn_reports_the_repeat_of_a_dropped_document_as_sent() -> None:
    pairs = [("a", SHARED_SENTENCE_FIRST), ("a", SHARED_SENTENCE_FIRST), ("b", HARBOR)]
    retriever = CpMemoryRetriever(retriever=ListRetriever(documents=_documents(pairs)), memory=CpMemory())
    config = _thread("reuse")
    returned = retriever.invoke("q", config)
    turn = retriever.pending.get("reuse")
    given = [d for d in returned if d.metadata["cpmemory"]["original_rank"] != 0]  # the repeat stays, same ranking
    prompt = retriever.prompt()
    sent = convert_to_openai_messages(prompt.invoke({"documents": list(reversed(given)), "question": "q"}, config))
    assert retriever.pending.get("reuse") is turn
    assert check_no_loss([("a", SHARED_SENTENCE_FIRST), ("b", HARBOR)], sent, query="q").ok
    reported = prompt.sent_documents(config)  # in prompt order, each as sent in this prompt
    assert [d.page_content for d in reported] == [SHARED_SENTENCE_FIRST, HARBOR]
    assert [d.metadata["cpmemory"]["prompt_position"] for d in reported] == [0, 1]
    assert {d.metadata["cpmemory"]["status"] for d in reported} == {"new"}


def test_the_repeated_document_case_through_the_facade_and_mem0() -> None:
    """The same input without a prompt built from edited documents: every path was already right."""
    memory = CpMemory()
    for number, blocks in enumerate([REPEATED, REPEATED[1:]]):
        turn = memory.prepare("f", "q", blocks)
        report = check_no_loss(blocks, turn.messages, query="q")
        assert report.ok, (number, report.violations)
        memory.commit(turn, f"answer {number}")
    mem0 = CannedMem0({"results": []})
    wrapper = CpMemoryMem0(mem0, CpMemory())
    for number, blocks in enumerate([REPEATED, REPEATED[1:]]):
        mem0.payload = {"results": [{"id": key, "memory": text} for key, text in blocks]}
        wrapper.search("q", conversation_id="m")
        report = check_no_loss(blocks, wrapper.chat_messages("m"), query="q")
        assert report.ok, (number, report.violations)
        wrapper.commit(f"answer {number}", conversation_id="m")


def test_item4_langchain_history_keeps_tool_calls_and_tool_messages() -> None:
    history = [
        HumanMessage("Multiply 6 by 7."),
        AIMessage("", tool_calls=[{"name": "mul", "args": {"a": 6, "b": 7}, "id": "c1"}]),
        ToolMessage("42", tool_call_id="c1", name="mul"),
        AIMessage("It is 42."),
    ]
    prompt = CpMemoryPromptRunnable(CpMemory())
    docs = [Document(page_content="Arithmetic facts.", id="m")]
    messages = prompt.invoke({"documents": docs, "question": "Why?", "history": history}, _thread("t4"))
    assert isinstance(messages[2], AIMessage) and messages[2].tool_calls[0]["id"] == "c1"
    assert isinstance(messages[3], ToolMessage) and messages[3].tool_call_id == "c1"
    caller = convert_to_openai_messages(history)
    report = check_no_loss([("m", "Arithmetic facts.")], convert_to_openai_messages(messages),
                           caller_messages=caller, query="Why?")
    assert report.ok, report.violations


def test_item10_mem0_commit_with_a_bad_answer_keeps_the_turn() -> None:
    memory = CpMemory()
    wrapper = CpMemoryMem0(CannedMem0([{"id": "a", "memory": "A memory."}]), memory)
    wrapper.search("q", conversation_id="r")
    with pytest.raises(InvalidInputError):
        wrapper.commit(None, conversation_id="r")  # type: ignore[arg-type]
    assert wrapper.commit("fine", conversation_id="r") == 1
    wrapper.search("q", conversation_id="r")
    with pytest.raises(InvalidInputError):
        wrapper.commit(3, conversation_id="r")  # type: ignore[arg-type]
    assert wrapper.abort(conversation_id="r") is True
    assert _open_reservations(memory, "r") == 0
    with pytest.raises(UnknownReservationError):
        wrapper.commit("late", conversation_id="r")


def test_item10_mem0_commit_during_a_store_outage_is_kept() -> None:
    store = FlakyStore()
    memory = CpMemory(store)
    wrapper = CpMemoryMem0(CannedMem0([{"id": "a", "memory": "A memory."}]), memory)
    wrapper.search("q", conversation_id="r")
    store.fail_commits = 1
    # the facade keeps a commit the store refused, to write it back: the turn is recorded, the count goes on
    assert wrapper.commit("answer", conversation_id="r") == 1
    assert len(wrapper.pending) == 0
    wrapper.search("q", conversation_id="r")
    assert wrapper.commit("answer", conversation_id="r") == 2


def test_item10_langchain_commit_errors_keep_the_turn() -> None:
    store = FlakyStore()
    memory = CpMemory(store)
    retriever = _retriever(k=2, memory=memory)
    config = _thread("t10")
    retriever.invoke("Paris", config)
    with pytest.raises(InvalidInputError):
        retriever.commit(5, config)
    store.fail_commits = 1
    assert retriever.commit("answer", config) == 1  # kept by the facade through the outage
    with pytest.raises(UnknownReservationError):
        retriever.commit("answer", config)  # committed once: nothing pending
    retriever.invoke("Lyon", config)
    with pytest.raises(InvalidInputError):
        retriever.commit(object(), config)
    assert retriever.abort(config) is True and _open_reservations(memory, "t10") == 0


@pytest.mark.parametrize("junk", [None, 5, 2.5, b"x", [1], {"a": 1}, object()])
def test_adapters_raise_only_typed_errors_on_bad_input(junk: Any) -> None:
    from cpmemory.errors import CpMemoryError

    wrapper = CpMemoryMem0(CannedMem0([{"id": "a", "memory": "A memory."}]), CpMemory())
    prompt = CpMemoryPromptRunnable(CpMemory())
    calls = [
        lambda: wrapper.search(junk, conversation_id="c"),
        lambda: wrapper.search("q", conversation_id="c", history=junk),
        lambda: wrapper.commit(junk, conversation_id="c"),
        lambda: prompt.invoke(junk, _thread("t")),
        lambda: prompt.invoke({"documents": junk, "question": "q"}, _thread("t")),
        lambda: prompt.invoke({"documents": [], "question": junk}, _thread("t")),
        lambda: prompt.invoke({"documents": [], "question": "q", "history": junk}, _thread("t")),
        lambda: prompt.commit(junk, _thread("t")),
    ]
    for call in calls:
        with contextlib.suppress(CpMemoryError):  # anything else fails the test
            call()


async def test_item10_async_mem0_commit_with_a_bad_answer_keeps_the_turn() -> None:
    from cpmemory.facade import AsyncCpMemory
    from mem0_cpmemory import AsyncCpMemoryMem0

    class AsyncCanned:
        async def search(self, query: str, **kwargs: Any) -> Any:
            return [{"id": "a", "memory": "A memory."}, {"id": "a", "memory": "Another memory."}]

    wrapper = AsyncCpMemoryMem0(AsyncCanned(), AsyncCpMemory())
    found = await wrapper.search("q", conversation_id="r")
    assert len({item["cpmemory"]["label"] for item in found}) == 2
    with pytest.raises(InvalidInputError):
        await wrapper.commit(None, conversation_id="r")  # type: ignore[arg-type]
    assert await wrapper.commit("fine", conversation_id="r") == 1
