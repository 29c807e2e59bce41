"""Workload loaders on the real data (small slices) and the synthetic generator."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from cpmemory.bench.loaders import (
    STAND_IN_TOKENS,
    WorkloadDataError,
    _pseudo_text,
    interleave,
    load_locomo,
    load_mt_rag,
    load_multihop,
    load_synthetic,
    load_workload,
)
from cpmemory.bench.tokenizer import count_tokens
from cpmemory.bench.trace import TraceRequest

DATA = next((p for p in (Path.cwd() / ".." / "shared" / "data", Path("/work/shared/data")) if p.is_dir()), None)
needs_data = pytest.mark.skipif(DATA is None, reason="no ../shared/data on this machine")


def test_missing_data_names_expected_path(tmp_path):
    with pytest.raises(WorkloadDataError, match=str(tmp_path / "locomo" / "locomo10.json")):
        load_workload("locomo", tmp_path)
    with pytest.raises(WorkloadDataError, match="multihop_rag"):
        load_multihop(tmp_path)
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope", tmp_path)


@needs_data
def test_locomo_first_conversation_top15_from_its_own_turns():
    trace = load_locomo(DATA, limit_conversations=1)
    assert not trace.multi_turn and len(trace.requests) > 100
    assert len(set(trace.sessions)) == len(trace.requests)  # independent requests
    for request in trace.requests:
        assert len(request.blocks) == 15
        assert all(block.id.startswith("conv-26:D") for block in request.blocks)
    # BM25 ranks a turn sharing the question's rare words first
    first = trace.requests[0]
    assert "support group" in first.query and "support group" in " ".join(b.text for b in first.blocks[:3]).lower()


@needs_data
def test_multihop_blocks_are_articles_with_identical_text_everywhere():
    trace = load_multihop(DATA)
    assert len(trace.requests) == 500 and not trace.multi_turn
    texts = defaultdict(set)
    for request in trace.requests:
        for block in request.blocks:
            texts[block.id].add(block.text)
    assert len(texts) == 326
    assert all(len(variants) == 1 for variants in texts.values())
    assert sum(not r.blocks for r in trace.requests) == 71  # null queries have no evidence


@needs_data
def test_mt_rag_is_multi_turn_with_ordered_turns_and_stand_ins():
    trace = load_mt_rag(DATA)
    assert trace.multi_turn and len(set(trace.sessions)) == 110
    last = {}
    for request in trace.requests:
        assert request.turn > last.get(request.session, -1)
        last[request.session] = request.turn
        assert request.answer
    stand_ins = [b for r in trace.requests for b in r.blocks if b.text == _pseudo_text(b.id, STAND_IN_TOKENS)]
    real = {b.id for r in trace.requests for b in r.blocks} - {b.id for b in stand_ins}
    assert len(stand_ins) > 1000 and len(real) >= 300  # 350 passages have text, the rest of the 1,800 stand in
    assert stand_ins and all(250 <= count_tokens(b.text) <= 400 for b in stand_ins[:50])
    assert _pseudo_text("x", 5) == _pseudo_text("x", 5) != _pseudo_text("y", 5)  # deterministic stand-ins


def test_synthetic_is_seeded_and_zipf_skewed():
    a = load_synthetic(requests=300, blocks_per_request=10, corpus_size=200, seed=3)
    assert a == load_synthetic(requests=300, blocks_per_request=10, corpus_size=200, seed=3)
    assert a != load_synthetic(requests=300, blocks_per_request=10, corpus_size=200, seed=4)
    counts = defaultdict(int)
    for request in a.requests:
        assert len({b.id for b in request.blocks}) == 10
        for block in request.blocks:
            counts[block.id] += 1
    ranked = sorted(counts.values(), reverse=True)
    assert ranked[0] > 5 * ranked[len(ranked) // 2]


def test_synthetic_multi_turn_repeats_earlier_blocks():
    trace = load_synthetic(requests=40, blocks_per_request=6, corpus_size=100, turns_per_session=4, seed=1)
    assert trace.multi_turn and len(set(trace.sessions)) == 10
    seen = defaultdict(set)
    repeats = 0
    for request in trace.requests:
        repeats += sum(block.id in seen[request.session] for block in request.blocks)
        seen[request.session].update(block.id for block in request.blocks)
    assert repeats >= 30 * 2  # 30 later turns, about 40% of 6 blocks each


def test_interleave_keeps_turn_order_and_bounds_concurrency():
    conversations = [[TraceRequest(f"c{c}", t, "q", ()) for t in range(1 + c % 3)] for c in range(7)]
    out = interleave(conversations, 2)
    assert sorted((r.session, r.turn) for r in out) == sorted((r.session, r.turn) for c in conversations for r in c)
    for session in {r.session for r in out}:
        turns = [r.turn for r in out if r.session == session]
        assert turns == sorted(turns)
    assert [r.session for r in out[:2]] == ["c0", "c1"]
