"""Hosted providers' prompt caches (OpenAI, Anthropic): the requests that make them hit, and what they save.

Layers (nothing here imports the proxy; the proxy imports :mod:`cpmemory.hosted.transport`)::

    chat (HostedChat: facade path)   transport (HostedTransport: the proxy's upstream)
            \\                              /
             provider (HostedSettings, HostedProvider: request / response, sans-IO)
            /            |              \\
    openai_body    anthropic_body     prices (Price, PriceTable, HostedUsage)

``cpmemory.testing.hosted_mock`` serves both providers' caching rules locally for tests and ``bench hosted``.
"""
from cpmemory.hosted.anthropic_body import CONVERSATION_PLACEMENT, CPMEMORY_PLACEMENT, MAX_BREAKPOINTS
from cpmemory.hosted.chat import AsyncHostedChat, HostedChat, HostedTurn
from cpmemory.hosted.prices import DEFAULT_PRICES, HostedUsage, Price, PriceTable, UsageTotals
from cpmemory.hosted.provider import HostedProvider, HostedRequest, HostedSettings
from cpmemory.hosted.transport import HostedTransport

__all__ = [
    "CONVERSATION_PLACEMENT", "CPMEMORY_PLACEMENT", "DEFAULT_PRICES", "MAX_BREAKPOINTS", "AsyncHostedChat",
    "HostedChat", "HostedProvider", "HostedRequest", "HostedSettings", "HostedTransport", "HostedTurn", "HostedUsage",
    "Price", "PriceTable", "UsageTotals",
]
