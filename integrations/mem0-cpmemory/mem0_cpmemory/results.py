"""Mem0 search results <-> cpmemory blocks (sans-IO, shared by the sync and async wrappers).

Shapes accepted (the shape is kept on the way back):

* ``{"results": [...], ...}`` from ``mem0.Memory`` / ``AsyncMemory`` and the hosted v2 API (other top-level keys,
  e.g. ``"relations"``, are carried through untouched);
* ``[...]`` from the hosted ``MemoryClient`` v1 API.

Rules for odd items (none of them ever drops a memory silently):

* not a mapping, or ``memory`` missing / not a string  -> :class:`~cpmemory.errors.InvalidInputError` naming the
  item's rank; nothing is prepared.
* no ``id`` (missing, None, empty)  -> an id is derived from the item's ``hash`` (or the text's content hash):
  ``"hash:<hash>"``; the item gets ``cpmemory.id_derived = True``.
* a non-string id (an int)  -> ``str(id)``.
* empty or whitespace-only ``memory``  -> kept in the results (after the others) with status ``"empty"``; there is
  no text to send.
* the same id twice with the same text  -> the later item is kept with status ``"duplicate"`` and
  ``duplicate_of`` (the rank of the first); its text reaches the prompt through the first.
* the same id twice with different texts  -> both are sent: the later one gets a free id ``"<id>#<hex>"``
  (``cpmemory.core.blocks.resolve_blocks``, never an id another result uses) and ``cpmemory.id_collision = True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cpmemory import Block
from cpmemory.adapters import (
    PreparedTurnLike,
    assign_blocks,
    decision_fields,
    passthrough_fields,
    prompt_ranks,
)
from cpmemory.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class ParsedResults:
    """One Mem0 search answer, split into what cpmemory needs and what must be handed back.

    Attributes:
        envelope: the top-level dict without ``"results"`` (None when the answer was a bare list).
        items: the result items, in Mem0's (relevance) order, as given.
        blocks: the blocks sent to cpmemory, in relevance order.
        item_block: for each item, the index of its block in ``blocks``, or None when it is not sent.
        notes: for each item, extra ``cpmemory`` fields (derived id, duplicate, empty).
    """

    envelope: Mapping[str, Any] | None
    items: tuple[Mapping[str, Any], ...]
    blocks: tuple[Block, ...]
    item_block: tuple[int | None, ...]
    notes: tuple[Mapping[str, Any], ...]


def _result_list(raw: object) -> tuple[Mapping[str, Any] | None, list[Any]]:
    if isinstance(raw, Mapping):
        if "results" not in raw:
            raise InvalidInputError(
                f"a Mem0 search answer needs a 'results' key, got keys {sorted(map(str, raw))}"
            )
        results = raw["results"]
        envelope: Mapping[str, Any] | None = {key: value for key, value in raw.items() if key != "results"}
    elif isinstance(raw, list):
        results, envelope = raw, None
    else:
        raise InvalidInputError(f"a Mem0 search answer must be a dict or a list, got {type(raw).__name__}")
    if not isinstance(results, list):
        raise InvalidInputError(f"Mem0 'results' must be a list, got {type(results).__name__}")
    return envelope, results


def _item_text(rank: int, item: object) -> str:
    if not isinstance(item, Mapping):
        raise InvalidInputError(f"Mem0 result #{rank} is a {type(item).__name__}, not a dict")
    text = item.get("memory")
    if not isinstance(text, str):
        found = "missing" if text is None else type(text).__name__
        raise InvalidInputError(f"Mem0 result #{rank} (id {item.get('id')!r}): 'memory' text is {found}")
    return text


def _item_id(item: Mapping[str, Any]) -> str | None:
    raw_id = item.get("id")
    if raw_id is None or raw_id == "":
        return None
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise InvalidInputError(f"Mem0 result id must be a string, got {type(raw_id).__name__}")
    return str(raw_id)


def parse_search_results(raw: object) -> ParsedResults:
    """Split a Mem0 search answer into blocks for cpmemory. Pure; O(n). Raises InvalidInputError (see module doc)."""
    envelope, results = _result_list(raw)
    entries = []
    for rank, item in enumerate(results):
        text = _item_text(rank, item)
        hint = item.get("hash") if isinstance(item.get("hash"), str) else None
        entries.append((_item_id(item), text, hint or None))
    assignment = assign_blocks(entries)
    return ParsedResults(envelope, tuple(results), assignment.blocks, assignment.item_block, assignment.notes)


def _rebuild(parsed: ParsedResults, ordered: list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]]:
    if parsed.envelope is None:
        return ordered
    return {"results": ordered, **parsed.envelope}


def _unsent_items(
    parsed: ParsedResults, base: Mapping[str, Any], labels: Mapping[int, str]
) -> list[dict[str, Any]]:
    """Items not sent to cpmemory (empty, duplicates), in original order; a duplicate carries its first's label."""
    out = []
    for rank, block_index in enumerate(parsed.item_block):
        if block_index is None:
            note = parsed.notes[rank]
            label = labels.get(note.get("duplicate_of", -1))
            fields = {**base, "label": label, "original_rank": rank, "prompt_position": None, **note}
            out.append({**parsed.items[rank], "cpmemory": fields})
    return out


def assemble_prepared(parsed: ParsedResults, turn: PreparedTurnLike) -> dict[str, Any] | list[dict[str, Any]]:
    """Return the results in prompt order, each with its ``cpmemory`` field, in the shape they came in. Pure.

    Items sent to cpmemory come first, in the order of the prompt (references after the full blocks); items not
    sent (empty, duplicates) follow in their original order. Every input item is in the output exactly once.
    """
    by_block = {decision.original_rank: decision for decision in turn.decisions}
    item_of_block = {block: rank for rank, block in enumerate(parsed.item_block) if block is not None}
    ordered: list[dict[str, Any]] = []
    labels: dict[int, str] = {}
    for block_index in prompt_ranks(
        [decision for decision in turn.decisions if decision.original_rank in item_of_block]
    ):
        rank = item_of_block[block_index]
        fields = {**decision_fields(turn, by_block[block_index]), "original_rank": rank, **parsed.notes[rank]}
        labels[rank] = fields["label"]
        ordered.append({**parsed.items[rank], "cpmemory": fields})
    for block_index in sorted(set(item_of_block) - set(by_block)):  # no decision: hand back as pass-through
        rank = item_of_block[block_index]
        ordered.append(
            {
                **parsed.items[rank],
                "cpmemory": {**passthrough_fields(rank, "no decision"), **parsed.notes[rank]},
            }
        )
    base = {
        "status": None,
        "conversation_id": turn.conversation_id,
        "turn": turn.turn,
        "reservation_id": turn.reservation_id,
        "degraded": turn.degraded,
    }
    return _rebuild(parsed, ordered + _unsent_items(parsed, base, labels))


def assemble_passthrough(parsed: ParsedResults, reason: str) -> dict[str, Any] | list[dict[str, Any]]:
    """Return the results in their original order, each marked ``passthrough`` (sent in full). Pure."""
    ordered = []
    for rank, block_index in enumerate(parsed.item_block):
        if block_index is not None:
            fields = {**passthrough_fields(rank, reason), **parsed.notes[rank]}
            ordered.append({**parsed.items[rank], "cpmemory": fields})
    base = {key: value for key, value in passthrough_fields(0, reason).items() if key != "original_rank"}
    return _rebuild(parsed, ordered + _unsent_items(parsed, base, {}))
