"""cpmemory.adapters: plain statuses for framework objects, the bounded pending turns."""

from __future__ import annotations

import json

import pytest

from cpmemory import CpMemory, CpMemoryConfig
from cpmemory.adapters import (
    DEFAULT_PENDING_LIMIT,
    PendingTurns,
    assign_blocks,
    decision_fields,
    passthrough_fields,
    pending_limit,
    plain_status,
)
from cpmemory.types import Status


def test_statuses_are_plain_strings_everywhere_an_adapter_writes_them() -> None:
    memory = CpMemory()
    turn = memory.prepare("c", "q", [("a", "Alpha."), ("b", "Beta.")])
    for decision in turn.decisions:
        fields = decision_fields(turn, decision)
        assert type(fields["status"]) is str and fields["status"] == "new"
        json.dumps(fields)
    assert type(passthrough_fields(0, "why")["status"]) is str
    notes = assign_blocks([("a", "Alpha.", None), ("a", "Alpha.", None), ("b", "  ", None)]).notes
    assert [type(note["status"]) for note in notes[1:]] == [str, str]
    assert plain_status(Status.REFERENCED) == "referenced" and type(plain_status(Status.REFERENCED)) is str


def test_pending_turns_displace_the_previous_turn_then_the_oldest() -> None:
    pending = PendingTurns(limit=2)
    assert pending.put("a", "a1") == [] and pending.put("b", "b1") == []
    assert pending.put("a", "a2") == ["a1"]  # same conversation: the previous turn, not an eviction
    assert pending.evicted == 0
    assert pending.put("c", "c1") == ["b1"]  # three conversations over a limit of two: the oldest (b) goes
    assert pending.evicted == 1 and len(pending) == 2
    assert pending.get("b") is None and pending.get("a") == "a2" and pending.get("c") == "c1"
    assert pending.discard("a", "a2") and not pending.discard("a", "a2")


def test_pending_limit_follows_the_facade() -> None:
    assert pending_limit(CpMemory(config=CpMemoryConfig(max_pending_turns=7))) == 7
    assert pending_limit(object()) == DEFAULT_PENDING_LIMIT
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="limit"):
            PendingTurns(limit=bad)  # type: ignore[arg-type]
