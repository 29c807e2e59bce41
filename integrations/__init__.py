"""Thin adapters between cpmemory and the frameworks users already have: Mem0 (``integrations.mem0``) and
LangChain / LangGraph (``integrations.langchain``). Each needs its extra; the core (``cpmemory``) never imports them.
"""
