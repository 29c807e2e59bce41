"""The cached segment index and history text: extended incrementally, limited to what a request sends, rebuilt
when stale."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cpmemory.core.annotations import build_user_message, format_block
from cpmemory.core.blocks import Block
from cpmemory.core.dedup import GivenHistory
from cpmemory.session.segments import SegmentCache
from cpmemory.types import ConversationKey

KEY = ConversationKey("t", "c")
SENTENCE_A = "Alpha sentence that is certainly long enough."
SENTENCE_B = "Bravo sentence that is certainly long enough."


def user_turn(text: str) -> list[dict[str, str]]:
    block = Block("x", text)
    content = build_user_message([format_block(block.label, text)], [], None, "q")
    return [{"role": "user", "content": content}, {"role": "assistant", "content": "a"}]


def test_extends_and_limits_to_the_history_sent() -> None:
    cache = SegmentCache()
    short = user_turn(SENTENCE_A)
    long = short + user_turn(SENTENCE_B)
    assert cache.for_history(KEY, long).holder(SENTENCE_B) is not None
    view = cache.for_history(KEY, short)  # a concurrent request that sends the shorter transcript
    assert view.holder(SENTENCE_A) is not None
    assert view.holder(SENTENCE_B) is None


def test_rebuilt_when_the_transcript_changed() -> None:
    cache = SegmentCache()
    cache.for_history(KEY, user_turn(SENTENCE_A))
    fresh = cache.for_history(KEY, user_turn(SENTENCE_B))
    assert fresh.holder(SENTENCE_A) is None and fresh.holder(SENTENCE_B) is not None


def test_bounded() -> None:
    cache = SegmentCache(max_conversations=3)
    for i in range(10):
        cache.for_history(ConversationKey("t", f"c{i}"), user_turn(SENTENCE_A))
    assert len(cache) == 3


def test_grows_from_an_empty_transcript_without_rebuilding() -> None:
    cache = SegmentCache()
    cache.for_history(KEY, [])
    built = cache._entries[KEY].index
    first = cache.for_history(KEY, user_turn(SENTENCE_A))
    second = cache.for_history(KEY, user_turn(SENTENCE_A) + user_turn(SENTENCE_B))
    third = cache.for_history(KEY, user_turn(SENTENCE_A) + user_turn(SENTENCE_B))
    assert first.messages == 2 and second.messages == 4 and third.messages == 4
    assert third.holder(SENTENCE_A) is not None and third.holder(SENTENCE_B) is not None
    assert cache._entries[KEY].index is built  # extended in place, never rebuilt


def test_edited_history_is_reindexed() -> None:
    cache = SegmentCache()
    original = user_turn(SENTENCE_A) + user_turn(SENTENCE_B)
    cache.for_history(KEY, original)
    edited = user_turn("Charlie sentence that is certainly long enough.") + original[2:]
    view = cache.for_history(KEY, edited)
    assert view.holder(SENTENCE_A) is None and view.holder(SENTENCE_B) is not None


_PIECES = st.sampled_from(["[D1234567]", "[D1234567]\n", "[D89abcdef0123]\nx", "text", "\n", "[D7654321] is shown",
                           "]", "[", "[Dabcdef1]\nblock body", ""])
_MESSAGES = st.lists(st.lists(_PIECES, max_size=4).map("".join), min_size=1, max_size=6)


@given(_MESSAGES, st.integers(min_value=0, max_value=6))
def test_cached_history_text_is_the_joined_history(contents: list[str], first: int) -> None:
    """Grown in two steps (as turns arrive), the cached text and headers equal a fresh GivenHistory's."""
    history = [{"role": "user" if n % 2 == 0 else "assistant", "content": text} for n, text in enumerate(contents)]
    cache = SegmentCache()
    key = ConversationKey("t", "c")
    for upto in (min(first, len(history)), len(history)):
        part = history[:upto]
        cache.for_history(key, part)
        cached = cache.given_history(key, part, 7, 12)
        fresh = GivenHistory.from_messages(part)
        assert cached.text == fresh.text
        assert {k: list(v) for k, v in cached._headers.items()} == {k: list(v) for k, v in fresh._headers.items()}
