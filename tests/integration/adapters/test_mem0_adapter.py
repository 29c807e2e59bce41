"""The Mem0 wrapper against the real mem0ai package (FAISS on disk, fake embedding, infer=False), offline."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

pytest.importorskip("mem0")

from cpmemory.adapters import PassthroughWarning
from cpmemory.core.blocks import Block
from cpmemory.core.invariants import check_no_loss
from cpmemory.facade import AsyncCpMemory, CpMemory
from mem0_cpmemory import AsyncCpMemoryMem0, CpMemoryMem0

FACTS = [
    "Caroline went to an LGBTQ support group on 7 May 2023.",
    "Melanie painted a sunrise over the lake in 2022.",
    "Caroline wants to pursue counseling and mental health work.",
    "Melanie ran a charity race for mental health last Saturday.",
    "Caroline is planning to adopt children as a single parent.",
]


def _items(found: Any) -> list[dict[str, Any]]:
    return found["results"] if isinstance(found, dict) else found


def _blocks(found: Any) -> list[Block]:
    """The memories in Mem0's own (relevance) order, as blocks, from the wrapper's annotated answer."""
    items = sorted(_items(found), key=lambda item: item["cpmemory"]["original_rank"])
    return [
        Block(str(item["id"]), item["memory"]) for item in items if item["cpmemory"]["status"] != "duplicate"
    ]


def _add_facts(wrapper: Any, user: str = "caroline") -> list[str]:
    ids = []
    for fact in FACTS:
        added = wrapper.add(fact, user_id=user, infer=False)
        ids.append(added["results"][0]["id"])
    return ids


def test_search_keeps_mem0_shape_and_every_memory(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    _add_facts(wrapper)
    plain = mem0_memory.search("mental health", filters={"user_id": "caroline"}, threshold=0.0)
    found = wrapper.search("mental health", user_id="caroline", threshold=0.0, conversation_id="chat-1")
    assert set(found) == set(plain)
    assert sorted(item["id"] for item in found["results"]) == sorted(item["id"] for item in plain["results"])
    assert len(found["results"]) == len(FACTS)
    for item, original in zip(
        sorted(found["results"], key=lambda i: i["cpmemory"]["original_rank"]), plain["results"]
    ):
        assert item["id"] == original["id"] and item["memory"] == original["memory"]
        assert {key: value for key, value in item.items() if key != "cpmemory"} == original
        assert item["cpmemory"]["status"] == "new"
    report = check_no_loss(_blocks(found), wrapper.chat_messages("chat-1"))
    assert report.ok, report.violations


def test_second_turn_refers_to_memories_shown_in_the_first(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    _add_facts(wrapper)
    first = wrapper.search("Caroline", user_id="caroline", threshold=0.0, top_k=3, conversation_id="chat-2")
    shown = {item["id"] for item in first["results"]}
    assert wrapper.commit("She went to a support group.", conversation_id="chat-2") == 1
    second = wrapper.search("Melanie", user_id="caroline", threshold=0.0, top_k=5, conversation_id="chat-2")
    statuses = {item["id"]: item["cpmemory"]["status"] for item in second["results"]}
    assert {statuses[i] for i in shown} == {"referenced"}
    assert {status for i, status in statuses.items() if i not in shown} == {"new"}
    messages = wrapper.chat_messages("chat-2")
    last = messages[-1]["content"]
    for item in second["results"]:
        assert (item["memory"] in last) == (item["id"] not in shown)
    report = check_no_loss(_blocks(second), messages)
    assert report.ok, report.violations


def test_memory_updated_by_mem0_is_resent_not_referenced(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    ids = _add_facts(wrapper)
    wrapper.search("painting", user_id="caroline", threshold=0.0, conversation_id="chat-3")
    wrapper.commit("A sunrise.", conversation_id="chat-3")
    new_text = "Melanie painted a sunset over the sea in 2023."
    wrapper.update(ids[1], text=new_text)
    assert wrapper.get(ids[1])["memory"] == new_text
    again = wrapper.search("painting", user_id="caroline", threshold=0.0, conversation_id="chat-3")
    by_id = {item["id"]: item for item in again["results"]}
    assert by_id[ids[1]]["memory"] == new_text
    assert by_id[ids[1]]["cpmemory"]["status"] == "changed"
    assert {item["cpmemory"]["status"] for i, item in by_id.items() if i != ids[1]} == {"referenced"}
    assert new_text in wrapper.chat_messages("chat-3")[-1]["content"]
    assert check_no_loss(_blocks(again), wrapper.chat_messages("chat-3")).ok


def test_conversation_comes_from_run_id_top_level_or_in_filters(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    for fact in FACTS[:3]:
        wrapper.add(fact, user_id="u", run_id="run-7", infer=False)
    found = wrapper.search("support", user_id="u", run_id="run-7", threshold=0.0)
    assert {item["cpmemory"]["conversation_id"] for item in found["results"]} == {"run-7"}
    assert len(found["results"]) == 3
    wrapper.commit("ok", conversation_id="run-7")
    again = wrapper.search("support", filters={"user_id": "u", "run_id": "run-7"}, threshold=0.0)
    assert {item["cpmemory"]["status"] for item in again["results"]} == {"referenced"}
    explicit = wrapper.search("support", run_id="run-7", threshold=0.0, conversation_id="other")
    assert {item["cpmemory"]["conversation_id"] for item in explicit["results"]} == {"other"}
    assert {item["cpmemory"]["status"] for item in explicit["results"]} == {"new"}


def test_without_conversation_results_pass_through_in_mem0_order(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    _add_facts(wrapper)
    plain = mem0_memory.search("Melanie", filters={"user_id": "caroline"}, threshold=0.0)
    with pytest.warns(PassthroughWarning):
        found = wrapper.search("Melanie", user_id="caroline", threshold=0.0)
    assert [item["id"] for item in found["results"]] == [item["id"] for item in plain["results"]]
    assert {item["cpmemory"]["status"] for item in found["results"]} == {"passthrough"}
    messages = wrapper.chat_messages()
    assert all(item["memory"] in messages[-1]["content"] for item in found["results"])
    assert wrapper.commit("nothing recorded") == 0
    with pytest.warns(PassthroughWarning, match="ordered online"):
        wrapper.search("Melanie", user_id="caroline", threshold=0.0)
    assert wrapper.chat_messages()[-1]["content"] == messages[-1]["content"]  # same blocks: the same online order


def test_abort_records_nothing(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    _add_facts(wrapper)
    wrapper.search("Caroline", user_id="caroline", threshold=0.0, conversation_id="chat-4")
    assert wrapper.abort(conversation_id="chat-4") is True
    assert wrapper.abort(conversation_id="chat-4") is False
    again = wrapper.search("Caroline", user_id="caroline", threshold=0.0, conversation_id="chat-4")
    assert {item["cpmemory"]["status"] for item in again["results"]} == {"new"}


def test_a_new_search_replaces_an_uncommitted_one(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    _add_facts(wrapper)
    wrapper.search("Caroline", user_id="caroline", threshold=0.0, top_k=2, conversation_id="chat-5")
    second = wrapper.search("Melanie", user_id="caroline", threshold=0.0, top_k=5, conversation_id="chat-5")
    assert {item["cpmemory"]["status"] for item in second["results"]} == {"new"}
    assert wrapper.commit("answer", conversation_id="chat-5") == 1
    third = wrapper.search("anything", user_id="caroline", threshold=0.0, top_k=5, conversation_id="chat-5")
    assert {item["cpmemory"]["status"] for item in third["results"]} == {"referenced"}
    transcript = " ".join(message["content"] for message in wrapper.chat_messages("chat-5"))
    assert "Question: Melanie" in transcript and "Question: Caroline" not in transcript


def test_other_methods_pass_through_unchanged(mem0_memory: Any) -> None:
    wrapper = CpMemoryMem0(mem0_memory, CpMemory())
    ids = _add_facts(wrapper)
    assert wrapper.get(ids[0]) == mem0_memory.get(ids[0])
    assert wrapper.get_all(filters={"user_id": "caroline"}) == mem0_memory.get_all(
        filters={"user_id": "caroline"}
    )
    assert wrapper.history(ids[0]) == mem0_memory.history(ids[0])
    wrapper.delete(ids[0])
    assert mem0_memory.get(ids[0]) is None
    assert wrapper.memory is mem0_memory
    assert wrapper.close == mem0_memory.close  # not listed: delegated by __getattr__


class HostedClientStub:
    """Stands in for mem0's hosted ``MemoryClient`` (which needs the network): it answers with the hosted shapes."""

    def __init__(self, items: list[dict[str, Any]], *, bare_list: bool) -> None:
        self.items = items
        self.bare_list = bare_list
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def search(self, query: str, **kwargs: Any) -> Any:
        self.calls.append((query, kwargs))
        return list(self.items) if self.bare_list else {"results": list(self.items)}


HOSTED_ITEMS = [
    {"id": "m1", "memory": "Prefers window seats", "user_id": "alex", "categories": ["travel"], "score": 0.9},
    {"id": "m2", "memory": "Vegetarian since 2019", "user_id": "alex", "categories": ["food"], "score": 0.8},
]


@pytest.mark.parametrize("bare_list", [True, False])
def test_hosted_client_shapes(bare_list: bool) -> None:
    client = HostedClientStub(HOSTED_ITEMS, bare_list=bare_list)
    wrapper = CpMemoryMem0(client, CpMemory())
    found = wrapper.search("food", user_id="alex", top_k=5, run_id="trip")
    assert client.calls == [("food", {"filters": {"user_id": "alex", "run_id": "trip"}, "top_k": 5})]
    assert isinstance(found, list) == bare_list
    assert sorted(item["id"] for item in _items(found)) == ["m1", "m2"]
    assert all(item["categories"] for item in _items(found))
    assert check_no_loss(
        [Block(i["id"], i["memory"]) for i in HOSTED_ITEMS], wrapper.chat_messages("trip")
    ).ok


def test_graph_relations_are_carried_through() -> None:
    client = HostedClientStub(HOSTED_ITEMS, bare_list=False)
    client.search = lambda query, **kwargs: {"results": list(HOSTED_ITEMS), "relations": [{"source": "alex"}]}
    found = CpMemoryMem0(client, CpMemory()).search("q", conversation_id="c")
    assert found["relations"] == [{"source": "alex"}]


async def test_async_memory_round_trip(async_mem0_memory: Any) -> None:
    wrapper = AsyncCpMemoryMem0(async_mem0_memory, AsyncCpMemory())
    for fact in FACTS:
        await wrapper.add(fact, user_id="caroline", infer=False)
    first = await wrapper.search(
        "Caroline", user_id="caroline", threshold=0.0, top_k=2, conversation_id="a-1"
    )
    assert {item["cpmemory"]["status"] for item in first["results"]} == {"new"}
    assert check_no_loss(_blocks(first), wrapper.chat_messages("a-1")).ok
    assert await wrapper.commit("first answer", conversation_id="a-1") == 1
    second = await wrapper.search(
        "Caroline", user_id="caroline", threshold=0.0, top_k=4, conversation_id="a-1"
    )
    statuses = [item["cpmemory"]["status"] for item in second["results"]]
    assert statuses.count("referenced") == 2 and statuses.count("new") == 2
    assert check_no_loss(_blocks(second), wrapper.chat_messages("a-1")).ok
    assert await wrapper.abort(conversation_id="a-1") is True
    everything = await wrapper.get_all(filters={"user_id": "caroline"})
    assert len(everything["results"]) == len(FACTS)


def test_default_facade_is_built_when_none_given(mem0_memory: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PassthroughWarning)
        wrapper = CpMemoryMem0(mem0_memory)
        assert isinstance(wrapper.cpmemory, CpMemory)
        assert isinstance(AsyncCpMemoryMem0(mem0_memory).cpmemory, AsyncCpMemory)


class AsyncHostedClientStub(HostedClientStub):
    """Stands in for mem0's hosted ``AsyncMemoryClient``."""

    async def search(self, query: str, **kwargs: Any) -> Any:  # type: ignore[override]
        return HostedClientStub.search(self, query, **kwargs)


async def test_async_hosted_client_bare_list() -> None:
    client = AsyncHostedClientStub(HOSTED_ITEMS, bare_list=True)
    wrapper = AsyncCpMemoryMem0(client, AsyncCpMemory())
    first = await wrapper.search("food", user_id="alex", conversation_id="trip")
    assert isinstance(first, list) and {item["cpmemory"]["status"] for item in first} == {"new"}
    assert await wrapper.commit("noted", conversation_id="trip") == 1
    second = await wrapper.search("food", user_id="alex", conversation_id="trip")
    assert {item["cpmemory"]["status"] for item in second} == {"referenced"}


def test_budget_is_passed_through_and_every_prompt_fits(mem0_memory: Any) -> None:
    from cpmemory.session.budget import estimate_tokens

    wrapper = CpMemoryMem0(mem0_memory, CpMemory(), max_prompt_tokens=600)
    _add_facts(wrapper)
    for turn in range(6):
        wrapper.search(f"Caroline {turn}", user_id="caroline", conversation_id="budget", threshold=0.0)
        pending = wrapper.pending_turn("budget")
        assert pending.budget == 600
        assert sum(estimate_tokens(m["content"]) + 8 for m in wrapper.chat_messages("budget")) <= 600
        wrapper.commit("Caroline's plans, in a sentence or two of answer text.", conversation_id="budget")
    wrapper.search("Melanie", user_id="caroline", conversation_id="budget", threshold=0.0, max_prompt_tokens=500)
    assert wrapper.pending_turn("budget").budget == 500
