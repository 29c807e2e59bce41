"""The deterministic benchmark tokenizer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.bench import tokenizer


def test_pieces_are_lossless_and_word_like() -> None:
    text = "I'm reading the information retrieval-augmented paper (RAG)!\n\n  Next."
    parts = tokenizer.pieces(text)
    assert "".join(parts) == text
    assert "'m" in parts and " the" in parts and " (" in parts
    assert max(len(p) for p in parts) <= tokenizer.MAX_PIECE_CHARS


def test_ids_are_stable_and_distinct() -> None:
    assert tokenizer.tokenize("hello world") == tokenizer.tokenize("hello world")
    a, b = tokenizer.tokenize("hello world")
    assert a != b
    assert all(0 <= t < 2**63 for t in (a, b))
    # a fixed id pins the hashing scheme (blake2b-64 of the piece, little endian, 63 bits)
    import hashlib

    expected = int.from_bytes(hashlib.blake2b(b" world", digest_size=8).digest(), "little") & (2**63 - 1)
    assert b == expected


def test_count_tokens_is_about_four_chars_per_token_on_prose() -> None:
    prose = (
        "Caroline said she went to the support group yesterday and found it really powerful. Melanie asked "
        "how the painting was going, and whether she would bring the kids camping next month by the lake."
    ) * 5
    ratio = len(prose) / tokenizer.count_tokens(prose)
    assert 3.3 <= ratio <= 5.0


def test_render_chat_is_chatml() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.render_chat(messages, add_generation_prompt=False).endswith("<|im_end|>\n")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=60)), max_size=5)
)
def test_tokenize_chat_equals_tokenizing_the_rendered_prompt(turns: list[tuple[str, str]]) -> None:
    messages = [{"role": role, "content": content} for role, content in turns]
    assert tokenizer.tokenize_chat(messages) == tokenizer.tokenize(tokenizer.render_chat(messages))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_pieces_roundtrip_any_text(text: str) -> None:
    assert "".join(tokenizer.pieces(text)) == text
    assert list(tokenizer.tokenize_cached(text)) == tokenizer.tokenize(text)
