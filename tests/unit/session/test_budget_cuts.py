"""Budget cuts are safe and visible: a history cut to a token budget keeps an assistant's tool calls and their
results together (the chat the engine gets is always valid) and says what it left out (``history_dropped``)."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmemory import CpMemory
from cpmemory.errors import PromptBudgetError
from cpmemory.stores.memory import InMemorySessionStore

BLOCKS = [{"id": "doc", "text": "A short document about the harbor."}]


def valid_chat(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Every tool result follows the assistant message that called it, and every call is answered before the next
    message that is not a tool result (the rule OpenAI-compatible engines enforce)."""
    open_calls: set[str] = set()
    for message in messages:
        if message["role"] == "tool":
            if message.get("tool_call_id") not in open_calls:
                return False
            open_calls.discard(message["tool_call_id"])
            continue
        if open_calls:
            return False
        if message["role"] == "assistant":
            open_calls = {call["id"] for call in message.get("tool_calls") or ()}
    return not open_calls


@st.composite
def histories(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A valid chat history: user and assistant messages, and assistant tool calls each followed by its results."""
    messages: list[dict[str, Any]] = []
    for number, kind in enumerate(draw(st.lists(st.sampled_from(["user", "assistant", "tools"]), max_size=16))):
        text = draw(st.text(alphabet="abcdefgh ", max_size=160))
        if kind != "tools":
            messages.append({"role": kind, "content": text})
            continue
        ids = [f"call-{number}-{i}" for i in range(draw(st.integers(1, 3)))]
        calls = [{"id": i, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": text})}}
                 for i in ids]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        messages.extend({"role": "tool", "tool_call_id": i, "content": text or "none"} for i in ids)
    return messages


class DownStore(InMemorySessionStore):
    def reserve(self, key, request):  # type: ignore[override]
        raise OSError("store unreachable")


def check_cut(history: list[dict[str, Any]], budget: int, store: InMemorySessionStore) -> None:
    memory = CpMemory(store=store)
    try:
        turn = memory.prepare("c", "What about the harbor?", BLOCKS, history=history, max_prompt_tokens=budget)
    except PromptBudgetError:
        return  # the turn alone does not fit: refused before anything is sent
    assert turn.prompt_tokens <= budget
    assert valid_chat(turn.messages)
    sent = turn.messages[1:-1]
    assert sent == history[len(history) - len(sent):]  # a suffix of the history, every field as given
    dropped = history[: len(history) - len(sent)]
    assert turn.history_dropped == (len(dropped), sum(m["role"] == "user" for m in dropped))
    expected = "unchecked" if turn.degraded else "diverged" if history else "matched"  # nothing committed yet
    assert turn.history == expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), st.integers(40, 900))
def test_a_budget_cut_keeps_tool_calls_with_their_results(history: list[dict[str, Any]], budget: int) -> None:
    check_cut(history, budget, InMemorySessionStore())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), st.integers(40, 900))
def test_a_pass_through_cut_keeps_tool_calls_with_their_results(history: list[dict[str, Any]], budget: int) -> None:
    check_cut(history, budget, DownStore())


def test_the_checker_rejects_an_orphaned_tool_result() -> None:
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    result = {"role": "tool", "tool_call_id": "t", "content": "r"}
    assert valid_chat([{"role": "system", "content": "s"}, call, result, {"role": "user", "content": "q"}])
    assert not valid_chat([{"role": "system", "content": "s"}, result, {"role": "user", "content": "q"}])
    assert not valid_chat([call, {"role": "user", "content": "q"}])


def test_what_the_stored_window_leaves_out_is_reported() -> None:
    memory = CpMemory()
    for number in range(6):
        turn = memory.prepare("w", f"question {number} " + "word " * 30, BLOCKS, max_prompt_tokens=260)
        memory.commit(turn, "answer " * 20)
    assert turn.history_dropped[1] >= 1 and turn.history_dropped[0] == 2 * turn.history_dropped[1]
    assert memory.counters.snapshot()["history_turns_dropped"] >= 1
