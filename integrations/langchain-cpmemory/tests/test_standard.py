"""LangChain's standard retriever tests (``langchain-tests``) run against ``CpMemoryRetriever``.

The wrapper reorders and de-duplicates what its inner retriever returns and never drops a Document, so the number
of results (``k``, in the constructor or in ``invoke``) is the inner retriever's: the suite checks that it reaches
the inner retriever and that every Document it returns comes back.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_tests.integration_tests import RetrieversIntegrationTests

from cpmemory import CpMemory
from langchain_cpmemory import CpMemoryRetriever

pytestmark = pytest.mark.filterwarnings("ignore::cpmemory.adapters.PassthroughWarning")

FACTS = [f"Fact {n}: the harbor gate {n} opens at {n} o'clock." for n in range(1, 8)]


class KeywordRetriever(BaseRetriever):
    """The inner retriever: the facts sharing the most words with the query, best first, ``k`` of them."""

    k: int = 4

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        words = set(query.lower().split())
        ranked = sorted(FACTS, key=lambda fact: -len(words & set(fact.lower().split())))
        return [Document(page_content=fact, id=f"fact-{FACTS.index(fact)}") for fact in ranked[: k or self.k]]


def cpmemory_retriever(k: int = 4) -> CpMemoryRetriever:
    """A ``CpMemoryRetriever`` over a ``KeywordRetriever`` returning ``k`` Documents."""
    return CpMemoryRetriever(retriever=KeywordRetriever(k=k), memory=CpMemory())


class TestCpMemoryRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> Any:
        return cpmemory_retriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"k": 4}

    @property
    def retriever_query_example(self) -> str:
        return "When does the harbor gate open?"


def test_a_conversation_gets_every_document_back_with_its_decision() -> None:
    retriever = cpmemory_retriever(k=3)
    config: Any = {"configurable": {"thread_id": "standard-1"}}
    documents = retriever.invoke("When does the harbor gate open?", config, k=3)
    assert len(documents) == 3
    assert {doc.metadata["cpmemory"]["status"] for doc in documents} == {"new"}  # first turn: all sent in full
    assert sorted(doc.metadata["cpmemory"]["original_rank"] for doc in documents) == [0, 1, 2]
