"""Both adapters bound their pending turns (the oldest aborted, counted) and warn once where nothing is
de-duplicated: Mem0's ``run_id`` filter, a LangChain retriever with no cpmemory prompt."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

pytest.importorskip("mem0")

from cpmemory import CpMemory, CpMemoryConfig
from cpmemory.errors import UnknownReservationError
from cpmemory.stores.base import ConversationKey
from langchain_cpmemory import CpMemoryPromptRunnable
from langchain_cpmemory.turns import NoPromptWarning
from mem0_cpmemory import CpMemoryMem0, RunIdFilterWarning
from tests.integration.adapters.test_langchain_adapter import _retriever, _thread
from tests.integration.adapters.test_no_silent_loss import CannedMem0


def _open_reservations(memory: CpMemory, conversation: str) -> int:
    state = memory.store._conversations.get(ConversationKey("default", conversation))
    return 0 if state is None else len(state.reservations)


def _bounded() -> CpMemory:
    return CpMemory(config=CpMemoryConfig(max_pending_turns=2))


def test_mem0_aborts_the_oldest_uncommitted_conversation_past_the_bound() -> None:
    memory = _bounded()
    wrapper = CpMemoryMem0(CannedMem0([{"id": "a", "memory": "A memory."}]), memory)
    for conversation in ("c1", "c2", "c3"):
        wrapper.search("q", conversation_id=conversation)
    assert wrapper.pending.limit == 2 and wrapper.pending.evicted == 1 and len(wrapper.pending) == 2
    assert _open_reservations(memory, "c1") == 0  # aborted: its reservation is released
    assert _open_reservations(memory, "c3") == 1
    with pytest.raises(UnknownReservationError):
        wrapper.commit("late answer", conversation_id="c1")
    assert wrapper.commit("answer", conversation_id="c3") == 1


def test_langchain_aborts_the_oldest_uncommitted_thread_past_the_bound() -> None:
    memory = _bounded()
    retriever = _retriever(k=2, memory=memory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoPromptWarning)
        for thread in ("t1", "t2", "t3"):
            retriever.invoke("Paris", _thread(thread))
    assert retriever.pending.evicted == 1 and len(retriever.pending) == 2
    assert _open_reservations(memory, "t1") == 0 and _open_reservations(memory, "t2") == 1
    with pytest.raises(UnknownReservationError):
        retriever.commit("late", _thread("t1"))
    assert retriever.commit("answer", _thread("t3")) == 1


def test_mem0_warns_once_when_run_id_filtered_out_the_users_memories(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    wrapper.add("Alice moved to Lyon.", user_id="alice", infer=False)
    with pytest.warns(RunIdFilterWarning, match="conversation_id="):
        found = wrapper.search("Alice", user_id="alice", run_id="chat-1", threshold=0.0)
    assert found["results"] == []  # Mem0 filtered by run_id: the user's memory has none
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunIdFilterWarning)
        wrapper.search("Alice", user_id="alice", run_id="chat-2", threshold=0.0)  # once per wrapper
        found = wrapper.search("Alice", user_id="alice", conversation_id="chat-3", threshold=0.0)
    assert [item["memory"] for item in found["results"]] == ["Alice moved to Lyon."]


def test_a_retriever_without_a_cpmemory_prompt_warns_once_from_its_second_turn() -> None:
    retriever = _retriever(k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoPromptWarning)
        retriever.invoke("Paris", _thread("w"))  # the prompt may still be made after the first retrieval
        retriever.commit("answer", _thread("w"))
    with pytest.warns(NoPromptWarning, match="nothing is de-duplicated"):
        retriever.invoke("Lyon", _thread("w"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoPromptWarning)
        retriever.invoke("Rome", _thread("w"))


@pytest.mark.parametrize("attach", ["prompt()", "shared pending turns"])
def test_a_retriever_feeding_a_cpmemory_prompt_never_warns(attach: str) -> None:
    retriever = _retriever(k=2)
    if attach == "prompt()":
        retriever.prompt()
    else:
        CpMemoryPromptRunnable(retriever.memory, pending=retriever.pending)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoPromptWarning)
        for question in ("Paris", "Lyon", "Rome"):
            retriever.invoke(question, _thread("p"))
