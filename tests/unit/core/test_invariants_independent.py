"""The no-loss checker is independent of the code it judges and flags the old behaviour of every issue-16 item."""

from __future__ import annotations

import ast
import inspect

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpmemory.core.invariants as invariants
import cpmemory.session.turn_input as turn_input_module
import cpmemory.session.turns as turns_module
from cpmemory.core import annotations
from cpmemory.core.blocks import Block
from cpmemory.core.dedup import DedupDecision, decide
from cpmemory.core.invariants import check_messages, check_no_loss
from cpmemory.facade import CpMemory

HARBOR = Block("a", "The harbor opens at nine.")
MUSEUM = Block("a", "The museum closes at five.")


def prompt(user: str, *history: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "sys"}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": h} for i, h in enumerate(history)]
    return messages + [{"role": "user", "content": user}]


def shown(*blocks: Block) -> list[str]:
    return [annotations.format_block(b.label, b.text) for b in blocks]


def test_the_checker_imports_nothing_from_cpmemory() -> None:
    tree = ast.parse(inspect.getsource(invariants))
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if name and name.startswith("cpmemory")]


def test_item1_old_behaviour_first_of_a_repeated_id_wins_is_flagged() -> None:
    old = prompt(annotations.build_user_message(shown(HARBOR), [], None, "When?"))
    report = check_no_loss([HARBOR, MUSEUM], old)
    assert not report.ok and any("museum" in v or "lost" in v or "not named" in v for v in report.violations)


def test_item3_old_behaviour_original_text_instead_of_the_compressed_one_is_flagged() -> None:
    original, dropped = Block("d1", "Paris is the capital of France."), Block("d2", "Lyon is known for its food.")
    compressed = Block("d1", "Paris (compressed).")
    old = prompt(annotations.build_user_message(shown(original, dropped), [], None, "q"))
    assert not check_no_loss([compressed], old).ok


def test_item4_old_behaviour_stripped_tool_calls_are_flagged() -> None:
    caller = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "f"},
    ]
    stripped = [{"role": "system", "content": "s"}, {"role": "assistant", "content": ""},
                {"role": "tool", "content": "42"}, {"role": "user", "content": "Question: q"}]
    assert len(check_messages(caller, stripped)) == 2
    assert check_messages(caller, [{"role": "system", "content": "s"}, *caller, {"role": "user", "content": "q"}]) == []


def test_item5_old_behaviour_dropped_instruction_is_flagged() -> None:
    caller = [{"role": "user", "content": "Answer in French, max 20 words."}]
    old = [{"role": "system", "content": "s"}, {"role": "user", "content": "Question: Who approved the budget?"}]
    assert check_messages(caller, old)
    kept = [old[0], caller[0], old[1]]
    assert check_messages(caller, kept) == []
    # the final user message may become the question (its text kept), the system prompt may merge system messages
    as_query = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is it?"}]
    sent = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "[D1234567]\nx\n\nQuestion: What is it?"}]
    assert check_messages(as_query, sent) == []
    assert check_messages([{"role": "user", "content": "hi"}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "x"}],
                          [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}])


def test_item9_old_behaviour_ambiguous_reference_is_flagged() -> None:
    x = Block("x", "Fact number 24392 about the collision search corpus.")
    y = Block("y", "Fact number 30153 about the collision search corpus.")
    assert x.label == y.label
    earlier = [annotations.build_user_message(shown(x), [], None, "q1"), "a1",
               annotations.build_user_message(shown(y), [], None, "q2"), "a2"]
    user = annotations.build_user_message([], [x.label], None, "q3")
    report = check_no_loss([x], prompt(user, *earlier))
    assert not report.ok and "another text" in report.violations[0]


def test_order_lookalike_inside_a_block_is_not_read_as_the_annotation() -> None:
    a, b = Block("a", "Alpha document."), Block("b", "Beta document text.")
    spoof = Block("c", "Gamma.\n" + annotations.ORDER_PREFIX + "Dffffff0")
    correct = prompt(annotations.build_user_message(shown(a, b, spoof), [], None, "q"))
    assert check_no_loss([a, b, spoof], correct).ok  # the old checker read the look-alike: "bad order"
    claims = Block("c", "Gamma.\n" + annotations.ORDER_PREFIX + f"{a.label} {b.label}" + annotations.ORDER_REST)
    wrong = prompt(annotations.build_user_message(shown(b, a, claims), [], None, "q"))
    # the last block claims the right order; it is block text, so the prompt order (b, a, c) counts: a violation
    # (the old checker took the claim for the annotation and passed this prompt)
    assert not check_no_loss([a, b, claims], wrong).ok


def test_full_text_must_end_at_a_line_break() -> None:
    a = Block("a", "Short text")
    longer = prompt(f"[{a.label}]\nShort text and more\n\nQuestion: q")
    assert not check_no_loss([a], longer).ok


def _broken_decide_referencing_new_blocks(*args, **kwargs):
    decisions = decide(*args, **kwargs)
    return [DedupDecision("referenced", None, (), (), 0, "") if d.status == "new" and i % 2 else d
            for i, d in enumerate(decisions)]


def _broken_decide_ignoring_changes(blocks, digests, history, **kwargs):
    """Treats a changed block (same id, new text) as already shown: references it instead of sending it."""
    decisions = decide(blocks, digests, history, **kwargs)
    return [DedupDecision("referenced", None, (), (), 0, "D" + digest[:7]) if d.status == "changed" else d
            for d, digest in zip(decisions, digests)]


@pytest.mark.parametrize("double", [_broken_decide_referencing_new_blocks, _broken_decide_ignoring_changes])
def test_a_deliberately_broken_dedup_is_caught(monkeypatch: pytest.MonkeyPatch, double) -> None:
    monkeypatch.setattr(turns_module, "decide", double)
    mem = CpMemory()
    first = [Block(f"d{i}", f"Document {i} says something specific.") for i in range(4)]
    mem.commit(mem.prepare("c", "q1", first), "a1")
    second = [Block("d0", "Document 0 was edited since."), *first[1:], Block("d9", "A brand new document.")]
    turn = mem.prepare("c", "q2", second)
    assert not check_no_loss(second, turn.messages).ok


def test_a_first_id_wins_normalisation_double_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpmemory.core.blocks import ResolvedBlocks, to_block

    def first_wins(values):
        blocks, seen = [], set()
        for value in values:
            block = to_block(value)
            if block.id not in seen:
                seen.add(block.id)
                blocks.append(block)
        return ResolvedBlocks(tuple(blocks), tuple(range(len(blocks))))

    monkeypatch.setattr(turn_input_module, "resolve_blocks", first_wins)
    turn = CpMemory().prepare("c", "When?", [HARBOR, MUSEUM])
    assert not check_no_loss([HARBOR, MUSEUM], turn.messages).ok


texts = st.text(alphabet=st.sampled_from(list("abcdefgh .!?\n")), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(texts, min_size=1, max_size=5, unique=True), st.data())
def test_dropping_or_swapping_any_block_is_detected(block_texts: list[str], data: st.DataObject) -> None:
    blocks = [Block("same-id", text) for text in block_texts]  # every item counts, whatever its id
    user = annotations.build_user_message(shown(*blocks), [], None, "q")
    assert check_no_loss(blocks, prompt(user)).ok
    if len(blocks) > 1:
        i = data.draw(st.integers(0, len(blocks) - 2))
        swapped = [*blocks[:i], blocks[i + 1], blocks[i], *blocks[i + 2:]]
        assert not check_no_loss(blocks, prompt(annotations.build_user_message(shown(*swapped), [], None, "q"))).ok
    victim = data.draw(st.sampled_from(blocks))
    others = {s for b in blocks if b is not victim for s in invariants._segments(b.text)}
    if set(invariants._segments(victim.text)) - others:
        damaged = user.replace(annotations.format_block(victim.label, victim.text), f"[{victim.label}]\n", 1)
        assert not check_no_loss(blocks, prompt(damaged)).ok
