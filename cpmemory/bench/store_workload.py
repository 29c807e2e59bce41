"""The seeded workload of ``cpmemory bench store`` (and of its shared-state phase), and its latency quantiles.

``conversations`` conversations of ``turns`` turns, :data:`BLOCKS_PER_TURN` blocks per turn (about
:data:`BLOCK_CHARS` characters each) retrieved from a per-conversation topic (:data:`TOPIC_SIZE` blocks of a shared
corpus): :data:`KEPT_PER_TURN` are kept from the previous turn and the rest drawn from the topic.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from cpmemory.core.blocks import content_hash

BLOCKS_PER_TURN = 15
KEPT_PER_TURN = 7
TOPIC_SIZE = 60
BLOCK_CHARS = 600
_WORDS = ("context", "cache", "prefix", "memory", "agent", "token", "block", "query", "answer", "model", "index",
          "turn", "session", "reuse", "latency", "retrieval", "document", "engine", "attention", "order")


@dataclass(frozen=True, slots=True)
class Block:
    """One workload block: caller id, text and content hash."""

    id: str
    text: str
    digest: str


@dataclass(frozen=True, slots=True)
class Workload:
    """``turns[c][t]`` = the blocks of turn ``t`` of conversation ``c``, best-ranked first."""

    turns: list[list[list[Block]]]
    tenant: str = "bench"

    @property
    def conversations(self) -> int:
        return len(self.turns)


def make_workload(conversations: int, turns: int, seed: int = 0) -> Workload:
    """Build the seeded workload described in the module docstring. Pure, deterministic."""
    rng = random.Random(seed)
    corpus_size = max(TOPIC_SIZE * 4, conversations * TOPIC_SIZE // 3)
    corpus: list[Block] = []
    for number in range(corpus_size):
        words = " ".join(rng.choice(_WORDS) for _ in range(BLOCK_CHARS // 7))
        text = f"Document {number}: {words}"[:BLOCK_CHARS]
        corpus.append(Block(f"doc-{number}", text, content_hash(text)))
    all_turns: list[list[list[Block]]] = []
    for _ in range(conversations):
        topic = rng.sample(corpus, TOPIC_SIZE)
        previous: list[Block] = []
        conversation: list[list[Block]] = []
        for _ in range(turns):
            kept = rng.sample(previous, min(KEPT_PER_TURN, len(previous)))
            fresh = [block for block in rng.sample(topic, BLOCKS_PER_TURN * 2) if block not in kept]
            blocks = kept + fresh[: BLOCKS_PER_TURN - len(kept)]
            rng.shuffle(blocks)
            conversation.append(blocks)
            previous = blocks
        all_turns.append(conversation)
    return Workload(all_turns)


def quantile_ms(samples: list[float], quantile: float) -> float:
    """The ``quantile`` of ``samples`` (seconds) in milliseconds, rounded; NaN when there are none."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] * 1000, 4)
