"""History reconciliation: a caller that resends its whole conversation gets the prompt of one that sends only the
new message (pure; no IO).

OpenAI clients (the ``openai`` SDK, LangChain's ``ChatOpenAI``, agent frameworks) send the whole conversation with
every call, in their own form: their user messages hold the plain question, not the blocks, references and
annotations cpmemory sent. Built from that history, a prompt would no longer start with the previous turn's prompt
(the engine's prefix cache misses) and a reference to a block shown in an earlier turn would point at text the
prompt does not hold (so the block is sent again).

:func:`reconcile` compares the caller's history with the conversation's committed transcript. It *matches* when,
after any leading system messages, it holds the committed turns in order: each user message either exactly as
cpmemory sent it or in the caller's plain form (the question alone), each assistant message the committed answer,
and no message carrying anything else (tool calls, names). The turn is then planned from the transcript as it was
sent (exactly as for a caller that passes no history), so its prefix is byte-identical to the last turn's prompt
and its references stay valid. A history that does not match (edited, truncated, from another conversation, with
tool calls) is sent as the caller gave it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from cpmemory.core.annotations import SECTION_SEPARATOR, content_text, format_question
from cpmemory.session.turn_input import TurnInput
from cpmemory.types import Message

Outcome = Literal["matched", "diverged", "none", "unchecked"]
OUTCOMES: tuple[Outcome, ...] = ("matched", "diverged", "none", "unchecked")
"""matched: the caller's history is the committed transcript (planned from it); diverged: it is not (sent as
given); none: no history given; unchecked: nothing to compare it with (the store is unreachable and no local copy
of the conversation is known), sent as given."""

_EMPTY: tuple[Any, ...] = (None, "", (), [], {})


def plain_text(message: Mapping[str, Any]) -> str | None:
    """A message's text when it carries only a role and text content (other fields empty), else None. Pure."""
    for key, value in message.items():
        if key not in ("role", "content") and not _is_empty(value):
            return None
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and all(
        isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return content_text(list(content))
    return None


def _is_empty(value: Any) -> bool:
    try:
        return value in _EMPTY
    except TypeError:  # an unhashable or odd value compares badly: it is not empty
        return False


def is_plain_form(sent: str, text: str) -> bool:
    """Whether ``text`` is the caller's plain form of the user message ``sent``: the question that ends it. Pure."""
    question = format_question(text)
    if not sent.endswith(question):
        return False
    head = sent[: len(sent) - len(question)]
    return not head or head.endswith(SECTION_SEPARATOR)


def _matches(given: Mapping[str, Any], stored: Message) -> bool:
    role = given.get("role")
    if role != stored["role"] or role not in ("user", "assistant"):
        return False
    text = plain_text(given)
    if text is None:
        return False
    return text == stored["content"] or (role == "user" and is_plain_form(stored["content"], text))


def reconcile(
    turn_input: TurnInput, transcript: Sequence[Message] | None, transcript_start: int, turns: int
) -> tuple[Outcome, TurnInput]:
    """Compare the caller's history with the committed transcript; on a match, the turn as if no history was given.

    Args:
        turn_input: the validated call (its ``given_history`` is the caller's history, None when none was given).
        transcript: the committed turns after ``transcript_start`` (the store's, or the local copy's); None when
            unknown.
        transcript_start: committed turns before ``transcript``'s first (trimmed, or outside the turn window).
        turns: the committed turns.

    Returns:
        The outcome and the input to plan: on "matched", ``history`` and ``given_history`` are None (plan from the
        transcript) and leading system messages of the caller's history become the system prompt; else unchanged.
        Pure; O(history).
    """
    given = turn_input.given_history
    if given is None:
        return "none", turn_input
    if transcript is None:
        return "unchecked", turn_input
    lead = 0
    while lead < len(given) and given[lead].get("role") == "system":
        lead += 1
    rest = given[lead:]
    extra = len(rest) - len(transcript)
    if extra < 0 or (turns == 0 and rest):
        return "diverged", turn_input
    head = rest[:extra]
    if any(message.get("role") not in ("user", "assistant") for message in head):
        return "diverged", turn_input
    if sum(message.get("role") == "user" for message in head) != transcript_start:
        return "diverged", turn_input
    if not all(_matches(mine, theirs) for mine, theirs in zip(rest[extra:], transcript)):
        return "diverged", turn_input
    system_prompt = turn_input.system_prompt
    if lead:
        texts = [plain_text(message) for message in given[:lead]]
        if any(text is None for text in texts):
            return "diverged", turn_input
        system_prompt = "\n\n".join(text for text in texts if text is not None)
    return "matched", dataclasses.replace(
        turn_input, history=None, given_history=None, system_prompt=system_prompt
    )


def offered_history(turn_input: TurnInput, transcript: Sequence[Message] | None) -> Sequence[Mapping[str, Any]]:
    """The history a turn was offered, of which it sends a suffix: the caller's (less the leading system messages
    that became the system prompt on a match), else the stored transcript. ``turn_input`` is the call before
    :func:`reconcile`. Pure."""
    given = turn_input.given_history
    if given is None:
        return transcript or ()
    return given


def dropped(offered: Sequence[Mapping[str, Any]], sent: int, matched: bool) -> tuple[int, int]:
    """(messages, turns) of the offered history left out of the prompt, which sends its last ``sent`` messages
    (``matched``: leading system messages became the system prompt and are not counted). Pure."""
    start = 0
    if matched:
        while start < len(offered) and offered[start].get("role") == "system":
            start += 1
    left_out = offered[start : max(start, len(offered) - sent)]
    return len(left_out), sum(message.get("role") == "user" for message in left_out)
