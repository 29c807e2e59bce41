"""LangChain / LangGraph integration: a retriever wrapper, a prompt Runnable and LangGraph nodes over cpmemory.

Needs the ``langchain`` extra (``pip install 'cpmemory[langchain]'``: langchain-core; ``langgraph`` adds LangGraph); importing this
package without langchain-core raises :class:`cpmemory.errors.MissingDependencyError` naming that command.
LangGraph is needed only by :mod:`integrations.langchain.graph`.
"""

from __future__ import annotations

import importlib.util

from cpmemory.errors import MissingDependencyError

if importlib.util.find_spec("langchain_core") is None:
    raise MissingDependencyError("langchain", "langchain-core")

from integrations._common import PassthroughWarning
from integrations.langchain.documents import METADATA_KEY, relevance_order
from integrations.langchain.prompt import CpMemoryPromptRunnable
from integrations.langchain.retriever import CpMemoryRetriever

__all__ = [
    "METADATA_KEY",
    "CpMemoryPromptRunnable",
    "CpMemoryRetriever",
    "PassthroughWarning",
    "relevance_order",
]
