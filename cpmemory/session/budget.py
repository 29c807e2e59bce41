"""Token budgets: how a prompt is counted, and the default estimate.

A prompt is counted message by message: ``counter(content) + message_overhead_tokens`` per chat message (the
overhead stands for the chat template's role markers; 8 covers ChatML, Llama 3 and Mistral templates), so a budget
``B`` holds when ``sum(counter(m["content"]) + overhead) <= B``. The counter is any ``Callable[[str], int]``: the
engine's tokenizer (the proxy uses the engine's ``/tokenize``), a local tokenizer, or the default
:func:`estimate_tokens`.

The default estimate (:func:`estimate_tokens`) counts two lower-case letters (after an optional capital) as one
token, any other letter, digit, punctuation mark or whitespace character as one token (a single space between a word
and the next letter is free), every non-ASCII character as its UTF-8 byte count, plus one per text. Over the texts
(titles, dialog turns, passages, URLs) of the four public data sets in ``shared/data`` it never under-counts the
production tokenizers available offline (Mistral's tekken and SentencePiece, BERT's WordPiece), so on English prose a
budget is used well below its size. Random letter soup ("Sdyy") can take several times the estimate under any
tokenizer, and a small-vocabulary model (the ``.ci`` tiny model) counts more than the estimate on short proper
names and on the made-up words of `bench conversation`'s prompts: for those, count with the engine's tokenizer or
with :func:`utf8_bytes` (a strict bound for any byte-level BPE).
``python -m cpmemory_benchmarks.studies.token_estimate`` (benchmarks/) reruns the comparison.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cpmemory.core.annotations import content_text
from cpmemory.errors import PromptBudgetError, TokenCounterError

TokenCounter = Callable[[str], int]
"""Counts the tokens of one text (any non-negative int)."""

MESSAGE_OVERHEAD_TOKENS = 8
"""Tokens added per chat message for the template's role markers (default of ``message_overhead_tokens``)."""

COUNT_CACHE_ENTRIES = 1024
"""Texts whose count a :class:`PromptBudget` remembers (history messages repeat on every turn)."""

_CLASSES = str.maketrans(
    {
        **dict.fromkeys(string.ascii_lowercase, "a"),
        **dict.fromkeys(string.ascii_uppercase, "A"),
        **dict.fromkeys(string.digits, "0"),
        **dict.fromkeys(string.punctuation, "."),
        **{chr(i): "." for i in (*range(32), 127) if chr(i) not in string.whitespace},
        **{c: "\n" for c in string.whitespace if c != " "},
        " ": " ",
    }
)


def estimate_tokens(text: str) -> int:
    """The default token counter: an estimate that does not under-count common tokenizers on natural text.

    Rule (see the module docstring for the margins): one token per ASCII character, except that a run of ``L``
    lower-case letters costs ``ceil(L / 2)`` (a capital right before it is free), a letter touching a digit costs
    one more, a single space between a non-space and a letter or punctuation mark is free, and a non-ASCII
    character costs its UTF-8 bytes; plus one per text. Computed from character-class counts (``str.translate``
    and ``str.count``, no regex and no Python loop per character). Pure; O(len(text)).
    """
    classes = text.translate(_CLASSES)
    count = classes.count
    lower = count("a")
    ascii_chars = len(text.encode("ascii", "ignore"))
    non_ascii_bytes = len(text.encode("utf-8", "surrogatepass")) - ascii_chars
    free = count(" a") + count(" A") + count(" .")
    free -= count("  a") + count("  A") + count("  .") + count("\n a") + count("\n A") + count("\n .")
    if classes[:1] == " " and classes[1:2] in ("a", "A", "."):
        free -= 1  # a leading space has nothing to merge with
    letters = lower - count("aa") - count("Aa") + count("a0") + count("0a")
    return 1 + (ascii_chars - lower) - free + letters + non_ascii_bytes


def utf8_bytes(text: str) -> int:
    """A strict upper bound for byte-level BPE tokenizers (every token covers at least one byte). Pure."""
    return len(text.encode("utf-8", "surrogatepass")) + 1


def check_budget(value: object) -> int:
    """Validate a token budget: a positive int (PromptBudgetError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PromptBudgetError(f"max_prompt_tokens must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class PromptBudget:
    """A budget in tokens and the counter it is measured with.

    Attributes:
        limit: the most tokens a prompt may have.
        counter: counts one text.
        overhead: tokens added per message.
        cache: counts of recent texts (bounded; shared by the copies of one facade's budget).
    """

    limit: int
    counter: TokenCounter
    overhead: int = MESSAGE_OVERHEAD_TOKENS
    cache: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def text(self, text: str) -> int:
        """Tokens of one text under the counter (memoised).

        Raises:
            TokenCounterError: the counter raised or returned a negative or non-integer value.
        """
        known = self.cache.get(text)
        if known is not None:
            return known
        try:
            value = self.counter(text)
        except Exception as error:
            raise TokenCounterError(f"token_counter raised {type(error).__name__}: {error}") from error
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TokenCounterError(f"token_counter must return a non-negative int, got {value!r}")
        if len(self.cache) >= COUNT_CACHE_ENTRIES:
            self.cache.clear()
        self.cache[text] = value
        return value

    def message(self, message: Mapping[str, Any]) -> int:
        """Tokens of one chat message: its text, any other field (tool calls, ids, names) as JSON, the overhead."""
        if len(message) == 2 and isinstance(message.get("content"), str):  # the common case: role and text
            return self.text(message["content"]) + self.overhead
        extra = {key: value for key, value in message.items() if key not in ("role", "content")}
        parts = message.get("content")
        if not isinstance(parts, (str, type(None))):  # content parts: the text ones as text, others as JSON
            extra["content"] = [part for part in parts if not (isinstance(part, Mapping) and part.get("type") == "text")]
        fields = self.text(json.dumps(extra, sort_keys=True, default=str)) if extra else 0
        return self.text(content_text(parts)) + fields + self.overhead

    def messages(self, messages: Iterable[Mapping[str, str]]) -> int:
        """Tokens of a list of chat messages."""
        return sum(self.message(message) for message in messages)

    def with_limit(self, limit: int) -> PromptBudget:
        """The same counter (and cache) under another limit."""
        return PromptBudget(check_budget(limit), self.counter, self.overhead, self.cache)


def check_block_sizes(budget: PromptBudget, texts: Iterable[str]) -> None:
    """Raise PromptBudgetError when one block alone is larger than the budget (before anything is reserved)."""
    for position, text in enumerate(texts):
        size = budget.text(text)
        if size > budget.limit:
            raise PromptBudgetError(
                f"block {position} alone has {size} tokens, over the budget of {budget.limit}",
                budget.limit,
                size,
            )
