"""Issue 16 reproducers through the adapters (a canned in-process Mem0, real langchain-core objects)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("mem0")

from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage, convert_to_openai_messages

from cpmemory.core.invariants import check_no_loss
from cpmemory.errors import InvalidInputError, StoreUnavailableError, UnknownReservationError
from cpmemory.facade import CpMemory
from cpmemory.stores.base import ConversationKey
from cpmemory.stores.memory import InMemorySessionStore
from langchain_cpmemory import CpMemoryPromptRunnable
from mem0_cpmemory import CpMemoryMem0
from tests.integration.adapters.test_langchain_adapter import _retriever, _thread


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


def test_item10_mem0_commit_after_a_store_failure_can_be_retried() -> None:
    store = FlakyStore()
    memory = CpMemory(store)
    wrapper = CpMemoryMem0(CannedMem0([{"id": "a", "memory": "A memory."}]), memory)
    wrapper.search("q", conversation_id="r")
    store.fail_commits = 1
    with pytest.raises(StoreUnavailableError):
        wrapper.commit("answer", conversation_id="r")
    assert wrapper.commit("answer", conversation_id="r") == 1


def test_item10_langchain_commit_errors_keep_the_turn() -> None:
    store = FlakyStore()
    memory = CpMemory(store)
    retriever = _retriever(k=2, memory=memory)
    config = _thread("t10")
    retriever.invoke("Paris", config)
    with pytest.raises(InvalidInputError):
        retriever.commit(5, config)
    store.fail_commits = 1
    with pytest.raises(StoreUnavailableError):
        retriever.commit("answer", config)
    assert retriever.commit("answer", config) == 1
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
