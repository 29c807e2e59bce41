"""The accuracy run against a stand-in engine (an httpx transport): records, errors, resume, the summary."""
from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from cpmemory import Block
from cpmemory_benchmarks.accuracy import summarize
from cpmemory_benchmarks.accuracy_data import Question
from cpmemory_benchmarks.accuracy_prompts import CONDITIONS, build_prompts
from cpmemory_benchmarks.accuracy_run import ChatEngine, RecordFile, ask_all, latest, parse_reply, pending

SHARED = Block("shared", "The museum opens at nine. Tickets cost five euros.")


def _question(dataset: str, qid: str, chat: str, turn: int, query: str, gold: str, blocks: tuple[Block, ...],
              kind: str = "free") -> Question:
    return Question(dataset, qid, chat, turn, query, blocks, (gold,), frozenset({blocks[0].id}), kind, gold, "")


def _chats() -> list[list[Question]]:
    first = Block("hours", "The museum is closed on Mondays.")
    second = Block("city", "The museum is in Lyon, near the river.")
    return [[_question("locomo", "c1:q1", "c1", 1, "When does the museum open?", "nine", (SHARED, first)),
             _question("locomo", "c1:q2", "c1", 2, "How much is a ticket?", "five euros", (SHARED, second))],
            [_question("locomo", "c2:q1", "c2", 1, "Is it open on Mondays?", "No", (first, SHARED), "yesno")]]


class StandInEngine:
    """Answers every chat request; fails or answers empty for the questions named."""

    def __init__(self, fail: set[str] | None = None, empty: set[str] | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail, self.empty = fail or set(), empty or set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append(body)
        question = body["messages"][-1]["content"].rsplit("Question: ", 1)[-1]
        if question in self.fail:
            return httpx.Response(500, text="engine failure")
        usage = {"prompt_tokens": 50, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
        if body.get("logprobs"):
            top = [{"token": "No", "logprob": -0.2}, {"token": "Yes", "logprob": -1.9}, {"token": " no", "logprob": -3}]
            choice = {"message": {"content": "No"}, "finish_reason": "length",
                      "logprobs": {"content": [{"token": "No", "top_logprobs": top}]}}
        else:
            text = "" if question in self.empty else "It opens at nine."
            choice = {"message": {"content": text}, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice], "usage": usage})


def _run(engine: StandInEngine, prompts: list, path: Path) -> list:
    async def go() -> list:
        client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        chat = ChatEngine("http://engine", "stand-in", client=client)
        try:
            records = RecordFile(path)
            todo = pending(prompts, latest(records.load(), "stand-in"))
            return await ask_all([chat], todo, records, concurrency=2)
        finally:
            await chat.aclose()

    return asyncio.run(go())


def test_every_question_is_asked_under_every_condition_and_recorded(tmp_path: Path) -> None:
    prompts = build_prompts(_chats())
    engine = StandInEngine()
    written = _run(engine, prompts, tmp_path / "run.jsonl")
    assert len(written) == len(engine.calls) == 3 * len(CONDITIONS)
    assert all(call["temperature"] == 0.0 for call in engine.calls)
    yesno = [r for r in written if r.kind == "yesno"]
    assert {r.answer for r in yesno} == {"No"} and all(r.yes_logprob < r.no_logprob for r in yesno)
    assert all(p.lost == 0 for by_condition in prompts for p in by_condition.values())
    # the second turn's cpmemory prompt refers to the shared block instead of repeating it
    second = prompts[1]["cpmemory"].messages[-1]["content"]
    assert "shown earlier" in second and SHARED.text not in second
    assert SHARED.text in prompts[1]["original"].messages[-1]["content"]


def test_a_run_resumes_and_asks_again_only_errors_and_changed_prompts(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    prompts = build_prompts(_chats())
    _run(StandInEngine(fail={"How much is a ticket?"}), prompts, path)
    with path.open("a", encoding="utf-8") as handle:
        handle.write('{"dataset": "locomo", "qid": "c1:q1", "cond')  # a torn line from an interrupted write
    again = StandInEngine()
    written = _run(again, prompts, path)
    assert {(r.qid, r.condition) for r in written} == {("c1:q2", c) for c in CONDITIONS}
    assert _run(StandInEngine(), prompts, path) == []
    # another prompt for the same question (here: without its chat's first turn) is asked again
    edited = build_prompts([[_chats()[0][1]]])  # asked as a first turn: a different prompt
    assert len(pending(edited, latest(RecordFile(path).load(), "stand-in"))) == len(CONDITIONS)


def test_errors_and_empty_answers_are_counted_not_scored(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    prompts = build_prompts(_chats())
    _run(StandInEngine(fail={"How much is a ticket?"}, empty={"When does the museum open?"}), prompts, path)
    figures = summarize(prompts, latest(RecordFile(path).load(), "stand-in"))
    assert figures["errors"] == len(CONDITIONS) and figures["empty"] == len(CONDITIONS)
    assert figures["n"] == 1 and figures["asked"] == 3  # only the yes/no chat answered under every condition
    assert figures["conditions"]["original"]["contain"] == 1.0
    diff = figures["paired"]["cpmemory"]
    assert diff["f1_diff"] == 0.0 and diff["mcnemar_p"] == 1.0
    assert (diff["yes_margin_n"], diff["yes_margin_diff"]) == (1, 0.0)  # the same logprobs under every condition


def test_unreachable_engine_is_an_error_record(tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> list:
        chat = ChatEngine("http://engine", "stand-in", client=httpx.AsyncClient(transport=httpx.MockTransport(refuse)))
        todo = [p for by_condition in build_prompts(_chats()[:1]) for p in by_condition.values()]
        try:
            return await ask_all([chat], todo, RecordFile(tmp_path / "run.jsonl"))
        finally:
            await chat.aclose()

    written = asyncio.run(go())
    assert written and all(r.error and r.error.startswith("unreachable") and not r.ok for r in written)


def test_a_deadline_stops_taking_new_prompts(tmp_path: Path) -> None:
    ticks = iter(range(100))

    async def go() -> list:
        chat = ChatEngine("http://engine", "stand-in",
                          client=httpx.AsyncClient(transport=httpx.MockTransport(StandInEngine())))
        todo = [p for by_condition in build_prompts(_chats()) for p in by_condition.values()]
        try:
            return await ask_all([chat], todo, RecordFile(tmp_path / "run.jsonl"), deadline=4,
                                 clock=lambda: float(next(ticks)))
        finally:
            await chat.aclose()

    assert len(asyncio.run(go())) == 2  # each prompt reads the clock three times: before, at the start, at the end


@pytest.mark.parametrize(("top", "answer"), [
    ([{"token": "Yes", "logprob": -1.0}, {"token": " yes", "logprob": -1.0}, {"token": "No", "logprob": -0.8}], "Yes"),
    ([{"token": "No", "logprob": -0.1}, {"token": "Maybe", "logprob": -2.0}], "No"),
])
def test_yes_no_by_summed_logprobs(top: list, answer: str) -> None:
    body = {"choices": [{"logprobs": {"content": [{"top_logprobs": top}]}, "finish_reason": "length"}], "usage": {}}
    reply = parse_reply(body, yesno=True)
    assert reply.answer == answer and reply.error is None
    if answer == "Yes":
        assert reply.yes_logprob == pytest.approx(-1.0 + math.log(2))


def test_malformed_replies_are_errors() -> None:
    assert parse_reply({"choices": []}, yesno=False).error.startswith("malformed")
    none = {"choices": [{"logprobs": {"content": [{"top_logprobs": [{"token": "Maybe", "logprob": -0.1}]}]}}]}
    assert parse_reply(none, yesno=True).error == "neither Yes nor No among the top logprobs"


def test_a_chat_goes_to_one_engine_in_order_and_every_engine_takes_chats(tmp_path: Path) -> None:
    prompts = build_prompts(_chats())
    first, second = StandInEngine(), StandInEngine()

    def answering(engine: StandInEngine) -> Any:
        async def handler(request: httpx.Request) -> httpx.Response:
            await asyncio.sleep(0)  # an engine's answer takes a while: the other engine's worker runs meanwhile
            return engine(request)
        return handler

    async def go() -> list:
        engines = [ChatEngine(f"http://engine-{i}", "stand-in",
                              client=httpx.AsyncClient(transport=httpx.MockTransport(answering(e))))
                   for i, e in enumerate((first, second))]
        todo = pending(prompts, {})
        try:
            return await ask_all(engines, todo, RecordFile(tmp_path / "run.jsonl"))
        finally:
            for engine in engines:
                await engine.aclose()

    written = asyncio.run(go())
    assert len(written) == len(first.calls) + len(second.calls) == 3 * len(CONDITIONS)
    assert first.calls and second.calls  # two chats, two free engines: one chat each
    chats = [{call["messages"][-1]["content"].rsplit("Question: ", 1)[-1] for call in engine.calls}
             for engine in (first, second)]
    assert {frozenset(c) for c in chats} == {frozenset({"When does the museum open?", "How much is a ticket?"}),
                                              frozenset({"Is it open on Mondays?"})}
    c1 = [(r.turn, r.condition) for r in written if r.chat == "c1"]
    assert c1 == [(1, c) for c in CONDITIONS] + [(2, c) for c in CONDITIONS]  # turn by turn, as built


def test_records_hold_no_gold_and_the_summary_scores_against_the_dataset(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    prompts = build_prompts(_chats())
    _run(StandInEngine(), prompts, path)
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines and all("golds" not in line for line in lines)
    with path.open("a", encoding="utf-8") as handle:  # a record written with a field this version does not know
        handle.write(json.dumps({**lines[0], "golds": ["nine"], "extra": 1}) + "\n")
    figures = summarize(prompts, latest(RecordFile(path).load(), "stand-in"))
    # "It opens at nine." contains the gold "nine" of c1:q1, not "five euros" of c1:q2; "No" is c2:q1's gold
    assert figures["n"] == 3
    assert figures["conditions"]["original"]["contain"] == pytest.approx(2 / 3, abs=1e-4)
