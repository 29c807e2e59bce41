"""Label collisions: two texts whose 7-digit labels collide never share a label in one prompt."""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmemory import CpMemory, CpMemoryConfig
from cpmemory.core.blocks import Block, content_hash
from cpmemory.core.invariants import check_no_loss


@functools.cache
def colliding_pairs(count: int = 2) -> list[tuple[str, str]]:
    """Distinct texts whose default labels collide, found by a deterministic birthday search (~30k hashes)."""
    first: dict[str, str] = {}
    pairs: list[tuple[str, str]] = []
    number = 0
    while len(pairs) < count:
        text = f"Colliding document {number}."
        short = content_hash(text)[:7]
        if short in first:
            pairs.append((first[short], text))
        else:
            first[short] = text
        number += 1
    return pairs


def _pair() -> tuple[Block, Block]:
    a, b = colliding_pairs()[0]
    return Block("a", a), Block("b", b)


def _labels(turn) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {d.block_id: d.label for d in turn.decisions}


def test_the_search_really_finds_a_collision() -> None:
    a, b = _pair()
    assert a.text != b.text and a.content_hash != b.content_hash and a.label == b.label


def test_a_later_colliding_block_gets_a_longer_label_used_consistently() -> None:
    a, b = _pair()
    mem = CpMemory()
    first = mem.prepare("conv", "q1", [a])
    assert _labels(first) == {"a": a.label}
    mem.commit(first, "answer 1")
    second = mem.prepare("conv", "q2", [b, a])
    labels = _labels(second)
    assert labels["a"] == a.label  # referenced under the label the history shows it under
    assert labels["b"] == "D" + b.content_hash[:12]
    assert {d.status for d in second.decisions} == {"new", "referenced"}
    assert f"[{labels['b']}]\n{b.text}" in second.messages[-1]["content"]
    assert check_no_loss([b, a], second.messages).ok
    mem.commit(second, "answer 2")
    third = mem.prepare("conv", "q3", [a, b])  # both referenced, each under its own label
    assert _labels(third) == labels
    assert [d.status for d in third.decisions] == ["referenced", "referenced"]
    assert check_no_loss([a, b], third.messages).ok
    given = mem.prepare("conv", "q3", [a, b], history=list(mem.state("conv").transcript))
    assert _labels(given) == labels and [d.status for d in given.decisions] == ["referenced", "referenced"]


def test_colliding_blocks_of_one_request_get_distinct_labels() -> None:
    a, b = _pair()
    turn = CpMemory().prepare("conv", "q", [a, b])
    labels = _labels(turn)
    assert labels["a"] == a.label and labels["b"] == "D" + b.content_hash[:12]
    assert check_no_loss([a, b], turn.messages).ok


def test_collision_label_length_comes_from_the_config() -> None:
    a, b = _pair()
    config = CpMemoryConfig(label_digits=8, collision_label_digits=20)
    turn = CpMemory(config=config).prepare("conv", "q", [a, b])
    labels = _labels(turn)
    if a.content_hash[:8] == b.content_hash[:8]:
        assert labels == {"a": "D" + a.content_hash[:8], "b": "D" + b.content_hash[:20]}
    else:  # 8 digits already tell them apart
        assert labels == {"a": "D" + a.content_hash[:8], "b": "D" + b.content_hash[:8]}
    assert check_no_loss([a, b], turn.messages).ok


def test_the_checker_rejects_one_label_for_two_texts() -> None:
    a, b = _pair()
    history = [
        {"role": "user", "content": f"[{a.label}]\n{a.text}\n\nQuestion: q1"},
        {"role": "assistant", "content": "x"},
    ]
    last = {"role": "user", "content": f"[{b.label}]\n{b.text}\n\nQuestion: q2"}
    report = check_no_loss([b], [*history, last])
    assert not report.ok and "names another text" in report.violations[0]
    assert check_no_loss([a], history[:1]).ok


POOL = [text for pair in colliding_pairs(2) for text in pair] + [
    f"Plain block {i} with its own words." for i in range(4)
]
request = st.lists(st.tuples(st.integers(0, 5), st.sampled_from(POOL)), max_size=5)
mode = st.sampled_from(["stored", "stored", "given"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(request, mode, st.booleans()), min_size=1, max_size=6), st.sampled_from([None, 1, 2])
)
def test_labels_stay_unique_per_prompt_across_conversations(plan, max_turns: int | None) -> None:
    mem = CpMemory(config=CpMemoryConfig(max_history_turns=max_turns))
    for number, (blocks, how, commit) in enumerate(plan):
        history = list(mem.state("conv").transcript) if how == "given" else None
        turn = mem.prepare("conv", f"q{number}", blocks, history=history)
        report = check_no_loss(blocks, turn.messages)
        assert report.ok, report.violations
        by_label: dict[str, set[str]] = {}
        for decision in turn.decisions:
            by_label.setdefault(decision.label, set()).add(decision.content_hash)
        assert all(len(hashes) == 1 for hashes in by_label.values())
        if commit:
            mem.commit(turn, f"answer {number}")
        else:
            mem.abort(turn)
