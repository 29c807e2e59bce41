"""Fixtures for the integration tests: real Mem0 / LangChain objects, fully offline.

Mem0 reads MEM0_TELEMETRY and MEM0_DIR when it is imported (and creates MEM0_DIR), so both are set here, before
any test module imports it: no telemetry, nothing written to the home directory, no network.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_MEM0_HOME = tempfile.mkdtemp(prefix="cpm-test-mem0-")
atexit.register(shutil.rmtree, _MEM0_HOME, True)  # also when the session is cut short
os.environ["MEM0_DIR"] = _MEM0_HOME
os.environ["MEM0_TELEMETRY"] = "false"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

EMBEDDING_SIZE = 32


@pytest.fixture(scope="session", autouse=True)
def _mem0_home() -> Iterator[str]:
    yield _MEM0_HOME
    shutil.rmtree(_MEM0_HOME, ignore_errors=True)


def mem0_config(path: Path, embedder: dict[str, Any], dims: int) -> dict[str, Any]:
    """A Mem0 config with a local FAISS store under ``path`` and an LLM that is never called (infer=False)."""
    from langchain_core.language_models import FakeListChatModel

    return {
        "vector_store": {
            "provider": "faiss",
            "config": {"path": str(path / "faiss"), "embedding_model_dims": dims, "collection_name": "cpm"},
        },
        "embedder": embedder,
        "llm": {"provider": "langchain", "config": {"model": FakeListChatModel(responses=["unused"])}},
        "history_db_path": str(path / "history.db"),
    }


def fake_embedder() -> dict[str, Any]:
    """Mem0's ``langchain`` embedder provider with langchain-core's deterministic fake embedding."""
    from langchain_core.embeddings import DeterministicFakeEmbedding

    return {"provider": "langchain", "config": {"model": DeterministicFakeEmbedding(size=EMBEDDING_SIZE)}}


@pytest.fixture
def mem0_memory(tmp_path: Path) -> Any:
    """A real ``mem0.Memory`` (FAISS in tmp_path, fake embedding)."""
    pytest.importorskip("mem0")
    pytest.importorskip("langchain")  # Mem0's langchain providers import the `langchain` package
    from mem0 import Memory

    return Memory.from_config(mem0_config(tmp_path, fake_embedder(), EMBEDDING_SIZE))


@pytest.fixture
def async_mem0_memory(tmp_path: Path) -> Any:
    """A real ``mem0.AsyncMemory`` (FAISS in tmp_path, fake embedding)."""
    pytest.importorskip("mem0")
    pytest.importorskip("langchain")
    from mem0 import AsyncMemory

    return AsyncMemory.from_config(mem0_config(tmp_path, fake_embedder(), EMBEDDING_SIZE))


@pytest.fixture
def mem0_config_for() -> Any:
    """The :func:`mem0_config` builder, for tests that pick their own embedder."""
    return mem0_config
