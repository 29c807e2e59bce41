"""Trace format: parsing, line-numbered errors, --skip-bad, round trip."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmemory.bench.trace import Trace, TraceBlock, TraceRequest, parse_lines, read_trace, write_trace
from cpmemory.errors import InvalidInputError, TraceFormatError


def line(**fields):
    base = {"session": "s1", "turn": 1, "query": "q", "blocks": [{"id": "a", "text": "alpha"}]}
    base.update(fields)
    return json.dumps(base)


def test_parses_meta_and_requests():
    lines = [json.dumps({"_meta": {"name": "demo", "multi_turn": True}}), line(arrival=0.5),
             line(turn=2, blocks=[{"id": 7, "text": "x", "tokens": 3}], arrival=1.5, answer="ok")]
    trace = parse_lines(lines)
    assert trace.name == "demo" and trace.multi_turn
    assert trace.requests[1] == TraceRequest("s1", 2, "q", (TraceBlock("7", "x", 3),), 1.5, "ok")


def test_flag_overrides_meta_and_defaults_to_independent():
    assert parse_lines([line()]).multi_turn is False
    assert parse_lines([json.dumps({"_meta": {"multi_turn": True}}), line()], multi_turn=False).multi_turn is False


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"session": "s", "turn": 1, "query": "q"}), "missing key 'blocks'"),
        (line(turn="1"), "turn must be a non-negative integer"),
        (line(turn=True), "turn must be a non-negative integer"),
        (line(session=""), "session must be a non-empty string"),
        (line(blocks={"id": "a"}), "blocks must be a list"),
        (line(blocks=[{"id": "a"}]), "blocks[0].text must be a string"),
        (line(blocks=[{"id": None, "text": "t"}]), "blocks[0].id"),
        (line(blocks=[{"id": "a", "text": "t", "tokens": -1}]), "tokens must be a non-negative integer"),
        (line(blocks=[{"id": "a", "text": "t"}, {"id": "a", "text": "u"}]), "repeated"),
        (line(arrival="soon"), "arrival must be a finite number"),
        (line(extra=1), "unknown keys"),
        (line(blocks=[{"id": "a", "text": ""}]), "empty text and no tokens count"),
        (line(arrival=2.0), "arrival is given here but missing on earlier lines"),
    ],
)
def test_bad_line_reports_its_line_number(bad, reason):
    with pytest.raises(TraceFormatError) as info:
        parse_lines([line(session="ok"), "", bad])
    assert info.value.line_number == 3
    assert reason in str(info.value) and "trace line 3" in str(info.value)
    assert isinstance(info.value, InvalidInputError)


def test_bad_meta_is_reported():
    with pytest.raises(TraceFormatError, match="multi_turn must be a boolean") as info:
        parse_lines(["", json.dumps({"_meta": {"multi_turn": "yes"}}), line()])
    assert info.value.line_number == 2


def test_meta_after_first_line_and_turn_regressions_are_errors():
    with pytest.raises(TraceFormatError, match="first line") as info:
        parse_lines([line(), json.dumps({"_meta": {}})])
    assert info.value.line_number == 2
    with pytest.raises(TraceFormatError, match="comes after turn 2") as info:
        parse_lines([line(turn=2), line(session="other", turn=1), line(turn=2)])
    assert info.value.line_number == 3


def test_skip_bad_keeps_going_and_records_errors():
    trace = parse_lines([line(), "{oops", line(turn=0), line(turn=5)], skip_bad=True)
    assert [r.turn for r in trace.requests] == [1, 5]
    assert [e.line_number for e in trace.skipped] == [2, 3]


def test_empty_trace_and_missing_file(tmp_path):
    with pytest.raises(TraceFormatError, match="no valid request"):
        parse_lines(["", "{bad"], skip_bad=True)
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
requests = st.lists(
    st.builds(lambda q, blocks, answer: (q, blocks, answer), text,
              st.lists(st.tuples(st.from_regex(r"[a-z0-9]{1,6}", fullmatch=True), text.filter(bool)), max_size=4,
                       unique_by=lambda pair: pair[0]),
              st.none() | text),
    min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(requests, st.booleans())
def test_write_then_read_round_trips(tmp_path_factory, items, multi_turn):
    original = Trace("t", tuple(TraceRequest(f"s{i % 3}", i, q, tuple(TraceBlock(b, t) for b, t in blocks),
                                             answer=answer) for i, (q, blocks, answer) in enumerate(items)),
                     multi_turn)
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    write_trace(original, path)
    assert read_trace(path) == original


def test_arrival_on_every_line_or_none_and_never_backwards():
    with pytest.raises(TraceFormatError, match="missing here") as info:
        parse_lines([line(arrival=1.0), line(session="b")])
    assert info.value.line_number == 2
    with pytest.raises(TraceFormatError, match="goes backwards") as info:
        parse_lines([line(arrival=1.0), line(session="b", arrival=1.0), line(session="c", arrival=0.5)])
    assert info.value.line_number == 3
    skipped = parse_lines([line(arrival=1.0), line(session="c", arrival=0.5)], skip_bad=True)
    assert len(skipped.requests) == 1 and skipped.skipped[0].line_number == 2


def test_empty_text_with_a_token_count_is_a_stand_in_unique_to_the_id():
    from cpmemory.bench.tokenizer import count_tokens

    trace = parse_lines([line(blocks=[{"id": "a", "text": "", "tokens": 1000}, {"id": "b", "text": "", "tokens": 1000}])])
    first, second = trace.requests[0].blocks
    assert count_tokens(first.text) == 1000 and count_tokens(second.text) == 1000
    assert first.text != second.text and not set(first.text.split()) & set(second.text.split())
