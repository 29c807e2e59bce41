"""Deterministic tokenizer used by the benchmarks and the prefix-cache simulator.

A prefix cache only needs *identical text -> identical token ids* and a token count close to a real BPE's; it
never needs a vocabulary. This module gives both without a model download:

1. The text is split by one regular expression, GPT-2 style, into pieces: a word with its leading space
   (``" the"``), a run of punctuation with its leading space (``" ("``), or a run of whitespace (``"\\n\\n"``).
2. A piece of up to :data:`MAX_PIECE_CHARS` (8) characters is one token (a stand-in for a BPE vocabulary's common
   words); a longer piece is cut into :data:`CHUNK_CHARS` (6) character chunks, so long or rare words cost several
   tokens. English prose comes out near 4 characters per token, like ``cl100k``.
3. Each piece maps to a stable integer id: the first 8 bytes of its blake2b digest, masked to 63 bits so the ids
   fit a signed 64-bit numpy array.

The split is lossless: ``"".join(pieces(text)) == text``. Concatenating two texts can change the pieces at the seam
(a trailing space joins the next word), exactly as with a real BPE; prompts are therefore tokenized as a whole.

Caching: piece ids are memoised (:func:`piece_id`), and :func:`tokenize_cached` memoises whole texts (block texts
repeat across requests), returning an immutable tuple.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache

MAX_PIECE_CHARS = 8
"""A piece of at most this many characters is one token."""

CHUNK_CHARS = 6
"""A longer piece is cut into chunks of this many characters."""

TOKEN_ID_MASK = (1 << 63) - 1
"""Token ids are non-negative and fit in a signed int64."""

_PIECE_PATTERN = re.compile(r"'(?:s|t|re|ve|m|ll|d)\b| ?[^\W_]+| ?[^\s\w]+|_+|\s+(?!\S)|\s+", re.UNICODE)
# "'(?:s|t|...)\b" an English contraction suffix ("'s", "'re"), one token as in BPE
# " ?[^\W_]+"  a word (letters/digits) with its optional leading space
# " ?[^\s\w]+" a run of punctuation/symbols with its optional leading space
# "_+"         underscores (word characters that are not letters or digits)
# "\s+(?!\S)"  whitespace not followed by a non-space (keeps the last space for the next word), as GPT-2 does
# "\s+"        any remaining whitespace

CHAT_START = "<|im_start|>"
CHAT_END = "<|im_end|>"


@lru_cache(maxsize=1 << 20)
def piece_id(piece: str) -> int:
    """Return the stable token id of one piece (blake2b, 63 bits). Pure; memoised."""
    digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & TOKEN_ID_MASK


def pieces(text: str) -> list[str]:
    """Split ``text`` into token pieces (lossless: the pieces concatenate back to ``text``). O(len(text))."""
    out: list[str] = []
    for match in _PIECE_PATTERN.finditer(text):
        piece = match.group()
        if len(piece) <= MAX_PIECE_CHARS:
            out.append(piece)
        else:
            out.extend(piece[i : i + CHUNK_CHARS] for i in range(0, len(piece), CHUNK_CHARS))
    return out


def tokenize(text: str) -> list[int]:
    """Return the token ids of ``text``. Deterministic across runs and machines. O(len(text))."""
    return [piece_id(piece) for piece in pieces(text)]


@lru_cache(maxsize=1 << 16)
def tokenize_cached(text: str) -> tuple[int, ...]:
    """Return the token ids of ``text`` as a tuple, memoised by text (use for block texts that repeat)."""
    return tuple(tokenize(text))


def count_tokens(text: str) -> int:
    """Return the number of tokens of ``text`` (memoised through :func:`tokenize_cached`)."""
    return len(tokenize_cached(text))


def render_chat(messages: Iterable[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
    """Render chat messages as a ChatML prompt, as an engine's chat template would.

    Each message becomes ``"<|im_start|>{role}\\n{content}<|im_end|>\\n"``; with ``add_generation_prompt`` the prompt
    ends with ``"<|im_start|>assistant\\n"``. Pure.
    """
    parts = [f"{CHAT_START}{message['role']}\n{message['content']}{CHAT_END}\n" for message in messages]
    if add_generation_prompt:
        parts.append(f"{CHAT_START}assistant\n")
    return "".join(parts)


def tokenize_chat(messages: Iterable[Mapping[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
    """Return the token ids of the rendered chat prompt (see :func:`render_chat`).

    Each message is tokenized on its own (its rendering starts with the ``<|im_start|>`` marker, so pieces never
    straddle two messages) and memoised by its rendered text, so the long messages that repeat across requests
    (system prompt, history, context) cost one dictionary lookup.
    """
    tokens: list[int] = []
    for message in messages:
        tokens.extend(tokenize_cached(f"{CHAT_START}{message['role']}\n{message['content']}{CHAT_END}\n"))
    if add_generation_prompt:
        tokens.extend(tokenize_cached(f"{CHAT_START}assistant\n"))
    return tokens
