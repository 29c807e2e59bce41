"""Token budgets (issue 13): every prompt fits, the window is prefix-stable, bad input changes nothing."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cpmemory import CpMemory
from cpmemory.core.invariants import check_no_loss
from cpmemory.errors import InvalidInputError, PromptBudgetError, StoreUnavailableError, TokenCounterError
from cpmemory.session.budget import PromptBudget, estimate_tokens, utf8_bytes
from cpmemory.session.config import CpMemoryConfig
from cpmemory.session.window import restart_start
from cpmemory.stores.memory import InMemorySessionStore

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega", "river", "stone", "cloud"]
TINY_TOKENIZER = Path("/root/.cache/cpmemory/tiny-model/tokenizer.json")


def doc(rng: random.Random, words: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def budget_tokens(messages: list[dict[str, str]], counter=estimate_tokens, overhead: int = 8) -> int:
    return sum(counter(m["content"]) + overhead for m in messages)


def run_conversation(mem: CpMemory, turns: int, seed: int, pool: int = 30, k: int = 5) -> list:
    rng = random.Random(seed)
    docs = [doc(rng) for _ in range(pool)]
    prepared = []
    for turn in range(turns):
        blocks = [{"id": f"d{i}", "text": docs[i]} for i in rng.sample(range(pool), k)]
        prepared_turn = mem.prepare("c", f"question {turn}?", blocks)
        report = check_no_loss(blocks, prepared_turn.messages)
        assert report.ok, report.violations
        mem.commit(prepared_turn, f"answer {turn} " + doc(rng, 20))
        prepared.append(prepared_turn)
    return prepared


def test_every_prompt_fits_and_the_window_restarts_prefix_stably() -> None:
    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=2500))
    turns = run_conversation(mem, 60, seed=1)
    sizes = [budget_tokens(turn.messages) for turn in turns]
    assert max(sizes) <= 2500 and all(turn.prompt_tokens == size for turn, size in zip(turns, sizes))
    restarts = 0
    for before, after in itertools.pairwise(turns):
        extended = before.messages[:-1] + [before.messages[-1]]
        if after.messages[: len(extended)] == extended:
            continue  # same window: the previous prompt is a prefix of this one
        restarts += 1
        assert after.dropped_turns > before.dropped_turns
    assert 0 < restarts < 30  # restarts happen, but most turns extend the previous prompt
    state = mem.state("c")
    assert len(state.transcript) // 2 <= 60 - turns[-1].dropped_turns  # the store keeps only the window


def test_resent_blocks_after_restart_and_references_stay_inside_the_prompt() -> None:
    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=1200))
    rng = random.Random(3)
    same = [{"id": "a", "text": doc(rng)}, {"id": "b", "text": doc(rng)}]
    statuses = []
    for turn in range(20):
        prepared = mem.prepare("c", f"q{turn}", same)
        assert check_no_loss(same, prepared.messages).ok
        assert budget_tokens(prepared.messages) <= 1200
        statuses.append({d.status for d in prepared.decisions})
        mem.commit(prepared, "ok " + doc(rng, 120))
    assert {"referenced"} in statuses and {"resent"} in statuses


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(min_value=900, max_value=6000),
    seed=st.integers(0, 10_000),
    window=st.sampled_from(["restart", "sliding"]),
    keep=st.floats(0.0, 0.6),
)
def test_property_prompts_fit_and_nothing_is_lost(budget: int, seed: int, window: str, keep: float) -> None:
    config = CpMemoryConfig(max_prompt_tokens=budget, history_window=window, history_restart_keep=keep)
    mem = CpMemory(store=InMemorySessionStore(max_transcript_turns=7), config=config)
    for turn in run_conversation(mem, 25, seed=seed, k=3):
        assert budget_tokens(turn.messages) <= budget


def test_caller_counter_and_per_call_budget() -> None:
    def words(text: str) -> int:
        return len(text.split())

    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=100_000, token_counter=words, message_overhead_tokens=0))
    rng = random.Random(5)
    for turn in range(30):
        blocks = [{"id": f"x{turn}", "text": doc(rng, 80)}]
        prepared = mem.prepare("c", "q", blocks, max_prompt_tokens=400)
        assert budget_tokens(prepared.messages, words, 0) <= 400 == prepared.budget
        mem.commit(prepared, doc(rng, 30))


def test_given_history_is_cut_to_the_budget_at_stable_points() -> None:
    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=1500))
    rng = random.Random(9)
    history: list[dict[str, str]] = []
    previous = None
    for turn in range(25):
        prepared = mem.prepare("g", f"q{turn}", [{"id": "z", "text": doc(rng)}], history=history)
        assert budget_tokens(prepared.messages) <= 1500
        if previous is not None and len(previous.messages) > 2:
            sent_before = previous.messages[1:-1]
            sent_now = prepared.messages[1:-1]
            if sent_now[: len(sent_before)] != sent_before:  # a cut moved: only forward, to a later message
                assert not sent_now or (sent_now[0] in history and history.index(sent_now[0]) > history.index(sent_before[0]))
        previous = prepared
        mem.commit(prepared, "a")
        history = history + [prepared.messages[-1], {"role": "assistant", "content": doc(rng, 40)}]


@pytest.mark.parametrize("budget", [0, -5, 2.5, True, "100"])
def test_bad_budget_is_a_typed_error(budget: object) -> None:
    with pytest.raises(ValidationError):
        CpMemoryConfig(max_prompt_tokens=budget)
    mem = CpMemory()
    with pytest.raises(PromptBudgetError):
        mem.prepare("c", "q", [], max_prompt_tokens=budget)
    assert mem.state("c").turns == 0 and mem.state("c").open_reservations == 0


def _raising(text: str) -> int:
    raise RuntimeError("tokenizer down")


@pytest.mark.parametrize("counter", [_raising, lambda t: -1, lambda t: 1.5, lambda t: True, lambda t: None])
def test_bad_counter_is_a_typed_error_and_changes_nothing(counter) -> None:
    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=1000, token_counter=counter))
    with pytest.raises(TokenCounterError):
        mem.prepare("c", "q", [{"id": "a", "text": "some text"}])
    state = mem.state("c")
    assert (state.turns, state.open_reservations, state.seen) == (0, 0, {})


def test_counter_failing_on_history_releases_the_reservation() -> None:
    calls = {"fail": False}

    def counter(text: str) -> int:
        if calls["fail"] and text.startswith("answer"):
            raise ValueError("cannot count")
        return estimate_tokens(text)

    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=2000, token_counter=counter))
    mem.commit(mem.prepare("c", "q", [{"id": "a", "text": "first"}]), "answer one")
    calls["fail"] = True
    with pytest.raises(TokenCounterError):
        mem.prepare("c", "q2", [{"id": "b", "text": "second"}])
    state = mem.state("c")
    assert (state.turns, state.open_reservations) == (1, 0)


def test_block_larger_than_the_budget_and_turn_alone_over_it() -> None:
    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=300))
    with pytest.raises(PromptBudgetError, match="block 1 alone"):
        mem.prepare("c", "q", [{"id": "a", "text": "short"}, {"id": "b", "text": "word " * 400}])
    four = [{"id": str(i), "text": "word " * 70} for i in range(4)]
    with pytest.raises(PromptBudgetError, match="new turn alone") as raised:
        mem.prepare("c", "q", four)
    assert raised.value.needed > raised.value.budget == 300
    assert isinstance(raised.value, InvalidInputError)
    state = mem.state("c")
    assert (state.turns, state.open_reservations) == (0, 0)


class _DownStore(InMemorySessionStore):
    def reserve(self, key, request):  # type: ignore[override]
        raise StoreUnavailableError("down")


def test_degraded_turn_fits_the_budget() -> None:
    mem = CpMemory(store=_DownStore(), config=CpMemoryConfig(max_prompt_tokens=800))
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "chat " * 100} for i in range(10)]
    blocks = [{"id": "a", "text": "block text " * 20}]
    prepared = mem.prepare("c", "q", blocks, history=history)
    assert prepared.degraded and budget_tokens(prepared.messages) <= 800
    assert check_no_loss(blocks, prepared.messages).ok


def test_restart_start_keeps_recent_turns_within_the_share() -> None:
    assert restart_start([100, 100, 100, 100], 10, 250) == 12  # keeps the last two
    assert restart_start([100, 100], 0, 10_000) == 1  # always drops at least one
    assert restart_start([], 4, 100) == 4
    assert restart_start([500, 50], 0, 0) == 2


def test_prompt_budget_caches_and_validates() -> None:
    seen = []
    budget = PromptBudget(10, lambda text: seen.append(text) or len(text), overhead=2)
    assert budget.messages([{"role": "user", "content": "abc"}, {"role": "user", "content": "abc"}]) == 10
    assert seen == ["abc"]
    assert utf8_bytes("é") == 3


def test_estimate_does_not_under_count_the_bench_tokenizer_on_prompts() -> None:
    from cpmemory.bench.tokenizer import count_tokens

    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=3000))
    for turn in run_conversation(mem, 20, seed=11):
        for message in turn.messages:
            assert count_tokens(message["content"]) <= estimate_tokens(message["content"])


@pytest.mark.skipif(not TINY_TOKENIZER.exists(), reason="the tiny model is built by .ci/vllm.sh")
def test_estimate_with_overhead_covers_the_tiny_model_on_prompts() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(TINY_TOKENIZER))
    mem = CpMemory(config=CpMemoryConfig(max_prompt_tokens=3000))
    for turn in run_conversation(mem, 20, seed=12):
        real = sum(len(tokenizer.encode(m["content"], add_special_tokens=False).ids) + 8 for m in turn.messages)
        assert real <= budget_tokens(turn.messages)
