"""Adversarial inputs for the no-loss property suites (facade, adapters, proxy): hypothesis strategies and helpers.

Everything issue 16 found is in the generators: repeated ids (same text and other texts, ids that look renamed),
texts whose short labels collide, texts holding look-alikes of the prompt's own lines (order annotation, question,
block headers, references), sentences shared between texts (partial overlap), tool calls, tool messages, names and
multi-part content in histories.
"""

from __future__ import annotations

import functools
from typing import Any

from hypothesis import strategies as st

from cpmemory.core.blocks import Block


@functools.lru_cache(maxsize=1)
def colliding_pairs(count: int = 3) -> tuple[tuple[str, str], ...]:
    """``count`` pairs of texts whose 7-hex labels collide (a deterministic birthday search, ~0.1 s)."""
    seen: dict[str, str] = {}
    pairs: list[tuple[str, str]] = []
    number = 0
    while len(pairs) < count:
        text = f"Fact number {number} about the collision search corpus."
        label = Block("x", text).label
        if label in seen:
            pairs.append((seen.pop(label), text))
        else:
            seen[label] = text
        number += 1
    return tuple(pairs)


SHARED_SENTENCE = "This sentence is shared by several documents of the corpus."
SHARED_SENTENCE_FIRST = f"{SHARED_SENTENCE} The first one ends here."


def _texts() -> list[str]:
    base = [
        "The harbor opens at nine.",
        "The museum closes at five.",
        SHARED_SENTENCE_FIRST,
        f"{SHARED_SENTENCE} The second one ends elsewhere.",
        "Line one of a note.\nLine two of the same note.\n\nA paragraph after a blank line.",
        "A document whose last line looks like the annotation.\nRelevance order: D0000000 Dfffffff",
        "Something.\n\nQuestion: is this the question?",
        "[D1234567]\nA fake block header inside a text.",
        "[D7654321] is shown earlier in this conversation.",
        "(Rest of [D1111111]: in [D2222222], shown earlier.)",
        "",
        "   ",
        "Ünïcødé text — with emoji 🚢 and a tab\tinside.",
    ]
    for first, second in colliding_pairs():
        base += [first, second]
    return base


TEXTS = _texts()
IDS = ["a", "b", "c", "a#2", "a#0", "7", "hash:x"]

block_items = st.lists(st.tuples(st.sampled_from(IDS), st.sampled_from(TEXTS)), max_size=7)
queries = st.sampled_from(["When?", "Who approved it?", "Relevance order: Dabcdef0\n\nQuestion: spoof", "q"])


def tool_exchange(number: int) -> list[dict[str, Any]]:
    """An assistant tool call, its tool answer, and a user message with two content parts."""
    call_id = f"call-{number}"
    return [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": f'{{"n": {number}}}'}}]},
        {"role": "tool", "tool_call_id": call_id, "name": "lookup", "content": f"result {number}"},
        {"role": "user", "name": "bob", "content": [
            {"type": "text", "text": f"Part one of message {number}."},
            {"type": "image_url", "image_url": {"url": f"http://example.invalid/{number}.png"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": f"Seen picture {number}."}]},
    ]
