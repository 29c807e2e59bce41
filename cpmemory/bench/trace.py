"""Replay traces: the JSON Lines format, its parser and its writer.

Format (one request per line, UTF-8)::

    {"_meta": {"name": "mt_rag", "multi_turn": true}}                 optional, first line only
    {"session": "c1", "turn": 1, "query": "...", "blocks": [{"id": "p7", "text": "...", "tokens": 212}],
     "arrival": 0.25, "answer": "..."}

* ``session`` (str) and ``turn`` (int >= 0): requests of one session are turns of one conversation, in file order
  with strictly increasing ``turn``.
* ``query`` (str); ``blocks``: list of ``{"id": str, "text": str, "tokens": int (optional)}`` in retrieval
  (relevance) order. A block with an empty ``text`` needs ``tokens``: it is replayed as a deterministic stand-in
  of that many tokens unique to its id (:func:`stand_in_text`). ``arrival`` (float seconds, optional: on every
  line or on none, never going backwards; ``bench replay --online`` uses it to form its windows); ``answer`` (str, optional): the
  assistant's reply, kept in the history of later turns when the trace is multi-turn (a deterministic stand-in is
  used when absent).
* The ``_meta`` line's ``multi_turn`` says whether a session's history is kept as the prompt prefix of its later
  turns (``true``) or whether every request is independent (``false``, the default). ``--multi-turn`` on the
  command line overrides it.

A malformed line raises :class:`~cpmemory.errors.TraceFormatError` carrying its 1-based line number, or is
skipped and recorded when ``skip_bad=True``.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpmemory.errors import TraceFormatError

META_KEY = "_meta"
_REQUEST_KEYS = frozenset({"session", "turn", "query", "blocks", "arrival", "answer"})


@dataclass(frozen=True, slots=True)
class TraceBlock:
    """One retrieved block of a request (``tokens`` is a hint; the replay counts with its own tokenizer)."""

    id: str
    text: str
    tokens: int | None = None


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: a turn of a session, with its blocks in retrieval order."""

    session: str
    turn: int
    query: str
    blocks: tuple[TraceBlock, ...]
    arrival: float | None = None
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    """A parsed trace.

    Attributes:
        name: workload name (from ``_meta.name``, the loader, or the file stem).
        requests: requests in file (arrival) order.
        multi_turn: True when a session's history is the prompt prefix of its later turns.
        skipped: errors of the lines skipped with ``skip_bad``.
    """

    name: str
    requests: tuple[TraceRequest, ...]
    multi_turn: bool = False
    skipped: tuple[TraceFormatError, ...] = field(default=(), compare=False)

    @property
    def sessions(self) -> list[str]:
        """Session id of every request, in request order."""
        return [request.session for request in self.requests]


def _require(condition: bool, line_number: int, reason: str) -> None:
    if not condition:
        raise TraceFormatError(line_number, reason)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_block(value: Any, index: int, line_number: int) -> TraceBlock:
    _require(isinstance(value, dict), line_number, f"blocks[{index}] must be an object")
    block_id = value.get("id")
    if _is_int(block_id):
        block_id = str(block_id)
    _require(isinstance(block_id, str) and block_id != "", line_number, f"blocks[{index}].id must be a non-empty string")
    _require(isinstance(value.get("text"), str), line_number, f"blocks[{index}].text must be a string")
    tokens = value.get("tokens")
    _require(tokens is None or (_is_int(tokens) and tokens >= 0), line_number,
             f"blocks[{index}].tokens must be a non-negative integer")
    text = value["text"]
    if text == "":
        _require(bool(tokens), line_number, f"blocks[{index}] (id {block_id!r}) has an empty text and no tokens "
                                            "count: give its text, or its size as \"tokens\"")
        text = stand_in_text(block_id, tokens)
    return TraceBlock(block_id, text, tokens)


def stand_in_text(block_id: str, tokens: int) -> str:
    """Deterministic text of exactly ``tokens`` benchmark tokens, unique to ``block_id`` (for blocks given by size).

    Every word is six hex digits of a digest of (id, position): with its leading space it is one token of
    :mod:`cpmemory.bench.tokenizer`, and two ids never share a word sequence.
    """
    import hashlib

    words = []
    for position in range(tokens):
        digest = hashlib.blake2b(f"{block_id}\x00{position}".encode(), digest_size=3).hexdigest()
        words.append("x" + digest[1:] if digest[0].isdigit() else digest)
    return " ".join(words)


def parse_request(obj: Any, line_number: int) -> TraceRequest:
    """Validate one decoded trace line and return it as a TraceRequest.

    Raises:
        TraceFormatError: naming ``line_number`` and the first problem found.
    """
    _require(isinstance(obj, dict), line_number, "a request must be a JSON object")
    unknown = set(obj) - _REQUEST_KEYS
    _require(not unknown, line_number, f"unknown keys {sorted(unknown)}")
    for key in ("session", "turn", "query", "blocks"):
        _require(key in obj, line_number, f"missing key {key!r}")
    _require(isinstance(obj["session"], str) and obj["session"] != "", line_number,
             "session must be a non-empty string")
    _require(_is_int(obj["turn"]) and obj["turn"] >= 0, line_number, "turn must be a non-negative integer")
    _require(isinstance(obj["query"], str), line_number, "query must be a string")
    _require(isinstance(obj["blocks"], list), line_number, "blocks must be a list")
    blocks = tuple(_parse_block(value, index, line_number) for index, value in enumerate(obj["blocks"]))
    ids = [block.id for block in blocks]
    _require(len(set(ids)) == len(ids), line_number, "a block id is repeated within the request")
    arrival = obj.get("arrival")
    _require(arrival is None or (isinstance(arrival, (int, float)) and not isinstance(arrival, bool)
                                 and math.isfinite(arrival)), line_number, "arrival must be a finite number")
    answer = obj.get("answer")
    _require(answer is None or isinstance(answer, str), line_number, "answer must be a string")
    return TraceRequest(obj["session"], obj["turn"], obj["query"], blocks,
                        None if arrival is None else float(arrival), answer)


def _arrival_problem(request: TraceRequest, earlier: list[TraceRequest]) -> str:
    """Why ``request``'s ``arrival`` cannot follow ``earlier`` ("" when it can): all or none, never backwards."""
    if not earlier:
        return ""
    previous = earlier[-1].arrival
    if (previous is None) != (request.arrival is None):
        return ("arrival is missing here but given on earlier lines" if request.arrival is None
                else "arrival is given here but missing on earlier lines")
    if previous is not None and request.arrival is not None and request.arrival < previous:
        return f"arrival {request.arrival} goes backwards (the previous request arrived at {previous})"
    return ""


def _parse_meta(obj: dict[str, Any], line_number: int, first: bool) -> dict[str, Any]:
    meta = obj[META_KEY]
    _require(first, line_number, "the _meta line must be the first line")
    _require(isinstance(meta, dict) and len(obj) == 1, line_number, "_meta must be the only key, holding an object")
    _require(isinstance(meta.get("multi_turn", False), bool), line_number, "_meta.multi_turn must be a boolean")
    _require(isinstance(meta.get("name", ""), str), line_number, "_meta.name must be a string")
    return meta


def _decode_lines(lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield line_number, json.loads(line)
        except json.JSONDecodeError as exc:
            yield line_number, TraceFormatError(line_number, f"invalid JSON ({exc.msg} at column {exc.colno})")


def parse_lines(lines: Iterable[str], *, name: str = "trace", skip_bad: bool = False,
                multi_turn: bool | None = None) -> Trace:
    """Parse trace lines (see the module docstring). Pure; O(total size).

    Args:
        lines: the lines of the file.
        name: workload name used when the trace has no ``_meta.name``.
        skip_bad: skip malformed lines (recorded in ``Trace.skipped``) instead of raising.
        multi_turn: overrides ``_meta.multi_turn`` when not None.

    Raises:
        TraceFormatError: the first malformed line (unless ``skip_bad``), or a trace without any request (line 0).
    """
    meta: dict[str, Any] = {}
    requests: list[TraceRequest] = []
    skipped: list[TraceFormatError] = []
    last_turn: dict[str, int] = {}
    seen_line = False
    for line_number, obj in _decode_lines(lines):
        first, seen_line = not seen_line, True
        try:
            if isinstance(obj, TraceFormatError):
                raise obj
            if isinstance(obj, dict) and META_KEY in obj:
                meta = _parse_meta(obj, line_number, first)
                continue
            request = parse_request(obj, line_number)
            previous = last_turn.get(request.session)
            _require(previous is None or request.turn > previous, line_number,
                     f"turn {request.turn} of session {request.session!r} comes after turn {previous}")
        except TraceFormatError as error:
            if not skip_bad:
                raise
            skipped.append(error)
            continue
        problem = _arrival_problem(request, requests)
        if problem:
            bad = TraceFormatError(line_number, problem)
            if not skip_bad:
                raise bad
            skipped.append(bad)
            continue
        last_turn[request.session] = request.turn
        requests.append(request)
    if not requests:
        raise TraceFormatError(0, "the trace holds no valid request")
    chosen = bool(meta.get("multi_turn", False)) if multi_turn is None else multi_turn
    return Trace(meta.get("name") or name, tuple(requests), chosen, tuple(skipped))


def read_trace(path: str | Path, *, skip_bad: bool = False, multi_turn: bool | None = None) -> Trace:
    """Read and parse a trace file (see :func:`parse_lines`).

    Raises:
        TraceFormatError: a malformed line; an unreadable file is reported as line 0.
    """
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as handle:
            return parse_lines(handle, name=path.stem, skip_bad=skip_bad, multi_turn=multi_turn)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(0, f"cannot read {path}: {exc}") from exc


def request_to_json(request: TraceRequest) -> dict[str, Any]:
    """Return the JSON object of one request (the inverse of :func:`parse_request`)."""
    obj: dict[str, Any] = {"session": request.session, "turn": request.turn, "query": request.query,
                           "blocks": [_block_to_json(block) for block in request.blocks]}
    if request.arrival is not None:
        obj["arrival"] = request.arrival
    if request.answer is not None:
        obj["answer"] = request.answer
    return obj


def _block_to_json(block: TraceBlock) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": block.id, "text": block.text}
    if block.tokens is not None:
        obj["tokens"] = block.tokens
    return obj


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as JSON Lines with a ``_meta`` first line. Overwrites ``path``."""
    with Path(path).open("w", encoding="utf-8") as handle:
        handle.write(json.dumps({META_KEY: {"name": trace.name, "multi_turn": trace.multi_turn}}) + "\n")
        handle.writelines(json.dumps(request_to_json(request), ensure_ascii=False) + "\n" for request in trace.requests)
