"""History reconciliation through the facade's ``history=`` and the local copy that outlives a store outage."""
from __future__ import annotations

from typing import Any

from cpmemory import CpMemory, CpMemoryConfig
from cpmemory.session.recent import Kept, RecentTranscripts
from cpmemory.session.reconcile import is_plain_form, plain_text
from cpmemory.stores.memory import InMemorySessionStore
from cpmemory.types import ConversationKey, TurnRecord

DOCS = [{"id": f"d{i}", "text": f"Document {i}: the harbor holds {i} boats. " * 6} for i in range(6)]


def run(memory: CpMemory, conversation: str, turns: int, resend: bool, **options: Any) -> list[list[dict[str, Any]]]:
    """Prompts of ``turns`` turns, the caller sending its plain history (``resend``) or none."""
    history: list[dict[str, Any]] = []
    prompts = []
    for number in range(turns):
        turn = memory.prepare(conversation, f"question {number}?", DOCS[number % 3 : number % 3 + 3],
                              history=history if resend else None, **options)
        prompts.append(turn.messages)
        memory.commit(turn, f"answer {number}")
        history += [{"role": "user", "content": f"question {number}?"},
                    {"role": "assistant", "content": f"answer {number}"}]
    return prompts


def test_a_resent_plain_history_gives_the_prompts_of_no_history() -> None:
    assert run(CpMemory(), "c", 5, resend=True) == run(CpMemory(), "c", 5, resend=False)


def test_with_a_turn_window_the_older_turns_the_caller_resends_are_reported_dropped() -> None:
    config = CpMemoryConfig(max_history_turns=2)
    assert run(CpMemory(config=config), "c", 5, resend=True) == run(CpMemory(config=config), "c", 5, resend=False)
    memory = CpMemory(config=config)
    run(memory, "c", 4, resend=False)
    history = [{"role": r, "content": f"{'question' if r == 'user' else 'answer'} {n}{'?' if r == 'user' else ''}"}
               for n in range(4) for r in ("user", "assistant")]
    turn = memory.prepare("c", "next?", DOCS[:2], history=history)
    assert turn.history == "matched" and turn.history_dropped == (4, 2)  # the window keeps turns 3 and 4


def test_leading_system_messages_become_the_system_prompt() -> None:
    memory = CpMemory()
    first = memory.prepare("c", "question 0?", DOCS[:2], history=[{"role": "system", "content": "Be terse."}])
    memory.commit(first, "answer 0")
    history = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "question 0?"},
               {"role": "assistant", "content": "answer 0"}]
    second = memory.prepare("c", "question 1?", DOCS[:2], history=history)
    assert second.history == "matched" and second.messages[0] == {"role": "system", "content": "Be terse."}
    assert second.messages[1]["content"] == first.user_message  # the turn as it was sent, blocks and all
    assert {d.status for d in second.decisions} == {"referenced"}


def test_a_history_that_is_not_the_transcript_is_sent_as_given() -> None:
    memory = CpMemory()
    run(memory, "c", 2, resend=False)
    for history in (
        [{"role": "user", "content": "question 0?"}, {"role": "assistant", "content": "answer 0"}],  # truncated
        [{"role": "user", "content": "question 0?"}, {"role": "assistant", "content": "edited"},
         {"role": "user", "content": "question 1?"}, {"role": "assistant", "content": "answer 1"}],
        [{"role": "user", "content": "question 0?", "name": "ann"}, {"role": "assistant", "content": "answer 0"},
         {"role": "user", "content": "question 1?"}, {"role": "assistant", "content": "answer 1"}],
    ):
        turn = memory.prepare("c", "next?", DOCS[:2], history=history)
        assert turn.history == "diverged" and turn.messages[1:-1] == history
        memory.abort(turn)
    assert memory.counters.snapshot()["histories_diverged"] == 3


def test_plain_forms() -> None:
    assert is_plain_form("[D1]\ntext\n\nQuestion: why?", "why?") and is_plain_form("Question: why?", "why?")
    assert not is_plain_form("[D1]\ntext\n\nQuestion: why?", "y?") and not is_plain_form("Question: why?", "why")
    assert plain_text({"role": "assistant", "content": "a", "refusal": None, "tool_calls": []}) == "a"
    assert plain_text({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == \
        "a\nb"
    assert plain_text({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}) is None


class SwitchStore(InMemorySessionStore):
    up = True

    def reserve(self, key, request):  # type: ignore[override]
        if not self.up:
            raise ConnectionError("store unreachable")
        return super().reserve(key, request)


def test_during_an_outage_a_resent_history_is_checked_against_the_local_copy() -> None:
    store = SwitchStore()
    memory = CpMemory(store=store)
    prompts = run(memory, "c", 2, resend=False)
    store.up = False
    history = [{"role": "user", "content": "question 0?"}, {"role": "assistant", "content": "answer 0"},
               {"role": "user", "content": "question 1?"}, {"role": "assistant", "content": "answer 1"}]
    turn = memory.prepare("c", "question 2?", DOCS[:2], history=history)
    assert turn.degraded and turn.history == "matched" and turn.turn == 3
    assert turn.messages[1:-1] == prompts[1][1:] + [{"role": "assistant", "content": "answer 1"}]
    edited = memory.prepare("c", "question 2?", DOCS[:2], history=history[:2])
    assert edited.degraded and edited.history == "diverged" and edited.messages[1:-1] == history[:2]


def test_the_local_copy_is_bounded_and_counts_kept_commits_it_drops() -> None:
    lost: list[int] = []
    copy = RecentTranscripts(max_chars=130, on_lost=lost.append)  # three turns of 40 characters
    record = TurnRecord(({"role": "user", "content": "u" * 30}, {"role": "assistant", "content": "a" * 10}), ())
    first, second = ConversationKey("t", "first"), ConversationKey("t", "second")
    assert copy.keep(first, Kept("", record)) == 0  # unknown conversation: no number
    copy.committed(second, 1, record)
    copy.committed(second, 2, record)
    assert len(copy) == 2 and not lost
    copy.committed(second, 3, record)  # over the bound: the least recently used conversation goes
    assert len(copy) == 1 and lost == [1] and not copy.pending(first)
    copy.committed(second, 4, record)  # alone over the bound: its oldest turn goes
    held = copy.history(second, None)
    assert (held.turns, held.start, len(held.messages)) == (4, 1, 6)


def test_a_store_that_lost_turns_gets_back_those_held_and_those_kept() -> None:
    copy = RecentTranscripts()
    key = ConversationKey("t", "c")
    records = [TurnRecord(({"role": "user", "content": f"u{n}"}, {"role": "assistant", "content": f"a{n}"}), ())
               for n in range(1, 5)]
    for number, record in enumerate(records[:3], start=1):
        copy.committed(key, number, record)
    assert copy.keep(key, Kept("r4", records[3])) == 4
    back = copy.take(key, stored_turns=1)  # the store came back holding turn 1 only
    assert [number for number, _ in back.rewrite] == [2, 3] and [kept.reservation_id for kept in back.kept] == ["r4"]
    assert not copy.pending(key)
    copy.give_back(key, back.kept)
    assert copy.pending(key)


def test_turns_kept_while_the_store_was_away_follow_the_stored_ones() -> None:
    store = SwitchStore()
    memory = CpMemory(store=store)
    run(memory, "c", 3, resend=False)
    store.up = False
    for number in (4, 5):
        turn = memory.prepare("c", f"question {number}?", DOCS[3:5])
        assert turn.degraded and turn.turn == number and len(turn.messages) == 2 * number
        assert memory.commit(turn, f"answer {number}") == number
    store.up = True
    after = memory.prepare("c", "question 6?", DOCS[3:5])
    assert not after.degraded and after.turn == 6
    assert {d.status for d in after.decisions} == {"referenced"}  # shown in the kept turns, now stored
    answers = [m["content"] for m in memory.state("c").transcript if m["role"] == "assistant"]
    assert answers == ["answer 0", "answer 1", "answer 2", "answer 4", "answer 5"]


def test_a_conversation_first_seen_during_an_outage_keeps_its_outage_turns() -> None:
    store = SwitchStore()
    store.up = False
    memory = CpMemory(store=store)
    first = memory.prepare("new", "question 0?", DOCS[:2])
    assert first.degraded and first.turn == 0 and memory.commit(first, "answer 0") == 0
    second = memory.prepare("new", "question 1?", DOCS[:2])
    assert second.degraded and second.messages[1:3] == [{"role": "user", "content": first.user_message},
                                                        {"role": "assistant", "content": "answer 0"}]
