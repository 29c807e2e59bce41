"""LangChain / LangGraph integration: a retriever wrapper, a prompt Runnable and LangGraph nodes over cpmemory.

The ``langchain-cpmemory`` distribution (from a checkout: ``pip install -e . -e integrations/langchain-cpmemory``; the ``langgraph`` extra
adds LangGraph). It uses only cpmemory's public API (``cpmemory`` and :mod:`cpmemory.adapters`). Importing this
package without langchain-core (an install with ``--no-deps``) raises :class:`cpmemory.errors.MissingDependencyError`
naming the install command.
LangGraph is needed only by :mod:`langchain_cpmemory.graph`.
"""

from __future__ import annotations

import importlib.util

from cpmemory.errors import MissingDependencyError

if importlib.util.find_spec("langchain_core") is None:
    raise MissingDependencyError("langchain", "langchain-core", "pip install -e . -e integrations/langchain-cpmemory (in a cpmemory checkout)")

from cpmemory.adapters import PassthroughWarning
from langchain_cpmemory.documents import METADATA_KEY, relevance_order
from langchain_cpmemory.prompt import CpMemoryPromptRunnable
from langchain_cpmemory.retriever import CpMemoryRetriever

__all__ = [
    "METADATA_KEY",
    "CpMemoryPromptRunnable",
    "CpMemoryRetriever",
    "PassthroughWarning",
    "relevance_order",
]
