"""``bench hosted`` on a small built workload (no data files): both arms under both providers' rules."""
from __future__ import annotations

import pytest

from cpmemory_benchmarks import hosted

pytest.importorskip("mem0_cpmemory")


def memories(chat: int, turn: int) -> tuple[tuple[str, str], ...]:
    """Fifteen of a chat's memories, most of them retrieved again on later turns (as a memory search does)."""
    ids = [(turn * 2 + offset) % 40 for offset in range(15)]
    return tuple((f"c{chat}m{index}", f"Memory {index} of {chat}: " + " ".join(f"f{word}" for word in range(60)))
                 for index in ids)


def chats(turns: int = 12) -> list[hosted.Turn]:
    return [hosted.Turn(f"chat-{chat}", f"Question {turn} of chat {chat}?", memories(chat, turn), "An answer.")
            for turn in range(turns) for chat in range(2)]


@pytest.mark.parametrize("provider", hosted.PROVIDERS)
def test_mem0_chats_cost_less_through_cpmemory(provider: str) -> None:
    result = hosted.run(provider, "locomo_mem0", chats(), hosted.DEFAULT_MODELS[provider], lambda steps: None,
                        budget=hosted.DEFAULT_BUDGET)
    assert result["cost_ratio"] < 1.0
    assert result["cpmemory"]["lost_blocks"] == 0
    assert result["cpmemory"]["max_breakpoints"] <= 4 and result["plain"]["max_breakpoints"] <= 4
    assert result["cpmemory"]["cached_input_tokens"] > result["plain"]["cached_input_tokens"]
    assert result["plain"]["requests"] == result["cpmemory"]["requests"] == 24


def test_the_table_has_a_row_per_arm() -> None:
    result = {"provider": "openai", "model": "gpt-5", "workloads": {"mt_rag": hosted.run(
        "openai", "mt_rag", chats(3), "gpt-5", lambda steps: None)}}
    rendered = hosted.table(result)
    assert rendered.row_count == 2
