"""The snippets of docs/guides/integrations.md run as written: real Mem0, LangChain and LangGraph objects, offline.

Each snippet is read from the page (the ``python`` block after its ``<!-- snippet: name -->`` marker) and run with
the names it leaves to the reader (``config``, ``llm``, ``vector_store``, ``chat_model``, ``retriever``) defined
here: a Mem0 config with FAISS on disk, a word-overlap embedding (so Mem0's default score threshold keeps related
memories), fake chat models that record what they were sent.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_core")
from langchain_core.embeddings import Embeddings
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from pydantic import Field

ROOT = Path(__file__).resolve().parents[3]
GUIDE = ROOT / "docs" / "guides" / "integrations.md"
PASSAGES = {
    "lyon": "Lyon is where two rivers meet: the Rhone and the Saone.",
    "lyon-food": "Lyon is famous for its bouchons serving quenelles.",
    "rhone": "After Lyon the Rhone flows south to the Mediterranean Sea.",
    "alps": "Mont Blanc is the highest peak of the Alps.",
}
EMBEDDING_SIZE = 64


def snippet(name: str) -> str:
    """The python block after ``<!-- snippet: name ...-->`` in the guide."""
    match = re.search(rf"<!-- snippet: {name}\b.*?-->\s*```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)
    assert match is not None, f"no '{name}' snippet in {GUIDE}"
    return match.group(1)


class WordsEmbedding(Embeddings):
    """Texts sharing words get close vectors (hashed bag of words, unit length); deterministic, offline."""

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * EMBEDDING_SIZE
        for word in re.findall(r"[a-z]+", text.lower()):
            vector[int(hashlib.sha256(word.encode()).hexdigest(), 16) % EMBEDDING_SIZE] += 1.0
        norm = math.sqrt(sum(value * value for value in vector)) or 1.0
        return [value / norm for value in vector]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._vector(text) for text in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._vector(text)


class RecordingChat(GenericFakeChatModel):
    """A fake chat model that keeps the messages of every call."""

    seen: list[Any] = Field(default_factory=list)

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        self.seen.append(messages)
        return super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)


def chat_model(turns: int) -> RecordingChat:
    return RecordingChat(messages=iter([AIMessage(content=f"Answer {n}.") for n in range(turns)]))


def vector_store() -> Any:
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(WordsEmbedding())
    store.add_texts(list(PASSAGES.values()), ids=list(PASSAGES))
    return store


def test_the_mem0_snippet_finds_per_user_memories_and_refers_to_them(tmp_path: Path, mem0_config_for: Any) -> None:
    pytest.importorskip("mem0")
    pytest.importorskip("langchain")
    config = mem0_config_for(tmp_path, {"provider": "langchain", "config": {"model": WordsEmbedding()}},
                             EMBEDDING_SIZE)
    prompts: list[list[dict[str, str]]] = []

    def llm(messages: list[dict[str, str]]) -> str:
        prompts.append(messages)
        return "She lives in Lyon."

    namespace: dict[str, Any] = {"config": config, "llm": llm}
    exec(snippet("mem0"), namespace)
    found = namespace["found"]["results"]
    assert [item["memory"] for item in found] == ["Alice moved to Lyon in 2021."]  # the user's memory is found
    assert found[0]["cpmemory"]["status"] == "referenced" and type(found[0]["cpmemory"]["status"]) is str
    assert "Alice moved to Lyon in 2021." in prompts[0][-1]["content"]  # turn 1: in full
    assert "Alice moved to Lyon in 2021." not in prompts[1][-1]["content"]  # turn 2: referenced
    assert len(namespace["memory"].pending) == 0  # both turns committed


def test_the_langchain_snippet_sends_a_document_once(recwarn: pytest.WarningsRecorder) -> None:
    model = chat_model(2)
    namespace: dict[str, Any] = {"vector_store": vector_store(), "chat_model": model}
    exec(snippet("langchain"), namespace)
    first, second = (messages[-1].content for messages in model.seen)
    assert PASSAGES["lyon"] in first and PASSAGES["lyon"] not in second
    assert "is shown earlier in this conversation" in second
    assert namespace["answer"].content == "Answer 1."
    assert len(namespace["retriever"].pending) == 0  # committed by the chain
    assert not [w for w in recwarn if "NoPrompt" in type(w.message).__name__]


def test_the_langgraph_snippet_keeps_plain_statuses() -> None:
    pytest.importorskip("langgraph")
    from cpmemory import CpMemory
    from langchain_cpmemory import CpMemoryRetriever

    retriever = CpMemoryRetriever(retriever=vector_store().as_retriever(), memory=CpMemory())
    namespace: dict[str, Any] = {"retriever": retriever, "chat_model": chat_model(2)}
    exec(snippet("langgraph"), namespace)
    statuses = namespace["statuses"]
    assert "referenced" in statuses and all(type(status) is str for status in statuses)


STRICT_SCRIPT = '''
import json, sys
sys.path.insert(0, {tests!r})
from test_guide_snippets import chat_model, snippet, vector_store
from cpmemory import CpMemory
from langchain_cpmemory import CpMemoryRetriever

retriever = CpMemoryRetriever(retriever=vector_store().as_retriever(), memory=CpMemory())
namespace = {{"retriever": retriever, "chat_model": chat_model(2)}}
exec(snippet("langgraph"), namespace)
saved = namespace["graph"].get_state(namespace["config"]).values  # read back from the checkpoint
print(json.dumps([doc.metadata["cpmemory"]["status"] for doc in saved["documents"]]))
'''


def test_a_strict_msgpack_checkpoint_reads_the_graph_state_back(tmp_path: Path) -> None:
    pytest.importorskip("langgraph")
    script = tmp_path / "strict.py"
    script.write_text(textwrap.dedent(STRICT_SCRIPT.format(tests=str(Path(__file__).parent))), encoding="utf-8")
    env = {**os.environ, "LANGGRAPH_STRICT_MSGPACK": "true"}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Blocked deserialization" not in done.stderr, done.stderr[-3000:]
    assert "referenced" in done.stdout.strip().splitlines()[-1]
