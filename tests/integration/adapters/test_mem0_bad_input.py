"""Malformed Mem0 answers: a clear error or a documented fallback, never a lost memory."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.core.blocks import Block
from cpmemory.core.invariants import check_no_loss
from cpmemory.errors import InvalidInputError, MissingDependencyError
from cpmemory.facade import CpMemory


def _load_adapter() -> Any:
    pytest.importorskip("mem0")
    return importlib.import_module("mem0_cpmemory")


class CannedMem0:
    """Answers every search with a fixed payload, as a misbehaving Mem0 backend would."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def search(self, query: str, **kwargs: Any) -> Any:
        return self.payload


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not a result", "dict or a list"),
        ({"memories": []}, "'results' key"),
        ({"results": {"id": "x"}}, "must be a list"),
        ([["id", "text"]], "not a dict"),
        ([{"id": "a"}], "'memory' text is missing"),
        ([{"id": "a", "memory": None}], "'memory' text is missing"),
        ([{"id": "a", "memory": 42}], "'memory' text is int"),
        ([{"id": 1.5, "memory": "x"}], "id must be a string"),
    ],
)
def test_malformed_answers_raise_a_typed_error(payload: Any, message: str) -> None:
    adapter = _load_adapter()
    facade = CpMemory()
    wrapper = adapter.CpMemoryMem0(CannedMem0(payload), facade)
    with pytest.raises(InvalidInputError, match=message):
        wrapper.search("q", conversation_id="c")
    assert wrapper.pending_turn("c") is None  # nothing was prepared


def test_documented_fallbacks_for_odd_items() -> None:
    adapter = _load_adapter()
    payload = {
        "results": [
            {"memory": "no id here", "hash": "abc123"},
            {"id": "dup", "memory": "first text"},
            {"id": "dup", "memory": "first text"},
            {"id": "dup", "memory": "another text"},
            {"id": "blank", "memory": "   "},
            {"id": 7, "memory": "integer id"},
        ]
    }
    wrapper = adapter.CpMemoryMem0(CannedMem0(payload), CpMemory())
    found = wrapper.search("q", conversation_id="c")["results"]
    assert len(found) == 6
    by_rank = {item["cpmemory"]["original_rank"]: item["cpmemory"] for item in found}
    assert by_rank[0]["id_derived"] is True and by_rank[0]["status"] == "new"
    assert by_rank[2]["status"] == "duplicate" and by_rank[2]["duplicate_of"] == 1
    assert by_rank[2]["label"] == by_rank[1]["label"]
    assert by_rank[3]["id_collision"] is True and by_rank[3]["status"] == "new"
    assert by_rank[4]["status"] == "empty"
    assert by_rank[5]["status"] == "new"
    prompt = wrapper.chat_messages("c")[-1]["content"]
    for text in ("no id here", "first text", "another text", "integer id"):
        assert text in prompt
    assert [item["cpmemory"]["status"] for item in found][-2:] == ["duplicate", "empty"]


def test_empty_answer_prepares_a_turn_without_memories() -> None:
    adapter = _load_adapter()
    wrapper = adapter.CpMemoryMem0(CannedMem0({"results": []}), CpMemory())
    assert wrapper.search("hello?", conversation_id="c") == {"results": []}
    assert wrapper.chat_messages("c")[-1]["content"].endswith("hello?")
    assert wrapper.commit("hi", conversation_id="c") == 1


def test_chat_messages_without_a_search_is_an_error() -> None:
    adapter = _load_adapter()
    from cpmemory.errors import UnknownReservationError

    wrapper = adapter.CpMemoryMem0(CannedMem0([]), CpMemory())
    with pytest.raises(UnknownReservationError):
        wrapper.chat_messages("never-searched")
    with pytest.raises(UnknownReservationError):
        wrapper.commit("answer", conversation_id="never-searched")


_ids = st.one_of(st.none(), st.just(""), st.sampled_from(["a", "b", "c"]), st.integers(0, 3))
_texts = st.sampled_from(["alpha", "beta", "gamma beta", "", "  ", "delta\nepsilon", "alpha"])
_items = st.lists(st.fixed_dictionaries({"id": _ids, "memory": _texts}), max_size=8)


@settings(max_examples=120, deadline=None)
@given(turns=st.lists(_items, min_size=1, max_size=3), bare_list=st.booleans())
def test_every_memory_reaches_the_prompt_or_is_accounted_for(
    turns: list[list[dict[str, Any]]], bare_list: bool
) -> None:
    adapter = _load_adapter()
    canned = CannedMem0(None)
    wrapper = adapter.CpMemoryMem0(canned, CpMemory())
    for items in turns:
        canned.payload = list(items) if bare_list else {"results": list(items)}
        found = wrapper.search("question", conversation_id="prop")
        out = found if bare_list else found["results"]
        handed_back = [{key: value for key, value in item.items() if key != "cpmemory"} for item in out]
        assert sorted(map(repr, handed_back)) == sorted(map(repr, items))
        sent = [
            i
            for i in sorted(out, key=lambda i: i["cpmemory"]["original_rank"])
            if i["cpmemory"]["status"] not in ("empty", "duplicate")
        ]
        blocks = [Block(str(i["cpmemory"]["original_rank"]), i["memory"]) for i in sent]
        report = check_no_loss(blocks, wrapper.chat_messages("prop"))
        assert report.ok, report.violations
        for item in out:
            if item["cpmemory"]["status"] == "duplicate":
                first = items[item["cpmemory"]["duplicate_of"]]
                assert first["memory"] == item["memory"]
            if item["cpmemory"]["status"] == "empty":
                assert not item["memory"].strip()
        wrapper.commit("answer", conversation_id="prop")


def test_import_without_mem0_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        name for name in sys.modules if name == "mem0_cpmemory" or name.startswith("mem0_cpmemory.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(
        sys.modules, "mem0", None
    )  # what an uninstalled package looks like to the import system
    with pytest.raises(MissingDependencyError, match="integrations/mem0-cpmemory") as caught:
        importlib.import_module("mem0_cpmemory")
    assert isinstance(caught.value, ImportError)


def test_the_core_never_imports_an_integration() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[3] / "cpmemory"
    adapters = ("langchain_cpmemory", "mem0_cpmemory", "integrations")
    offenders = [
        str(path)
        for path in root.rglob("*.py")
        for name in adapters
        if f"import {name}" in path.read_text(encoding="utf-8") or f"from {name}" in path.read_text(encoding="utf-8")
    ]
    assert offenders == []
