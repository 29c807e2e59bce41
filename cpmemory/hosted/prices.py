"""Input prices of hosted models and the cost of one call from its usage. Pure; no IO.

A provider bills a call's input in up to four kinds of tokens: read from its prompt cache, written to it (Anthropic
bills a write above the base price, more for the one-hour lifetime; OpenAI bills a write as ordinary input), and the
rest, uncached. :class:`HostedUsage` holds those counts, parsed from either provider's ``usage`` object;
:class:`PriceTable` maps a model to its :class:`Price` (longest matching name prefix, so a dated model id finds its
family) and is overridable per model.

The defaults are the providers' published list prices per million tokens for a few current models, as cited in
``docs/guides/hosted.md``; prices change, so a deployment passes its own (``PriceTable.with_overrides``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from cpmemory.errors import InvalidInputError

__all__ = ["DEFAULT_PRICES", "HostedUsage", "Price", "PriceTable", "UsageTotals", "parse_hosted_usage"]

PER_TOKENS = 1_000_000
"""Prices are per this many tokens."""


@dataclass(frozen=True, slots=True)
class Price:
    """Input and output prices of one model, per million tokens.

    Attributes:
        input: an uncached input token.
        cache_read: an input token read from the prompt cache.
        cache_write: an input token written to the cache (default lifetime).
        cache_write_long: an input token written with the long lifetime (Anthropic's one hour).
        output: an output token.
    """

    input: float
    cache_read: float
    cache_write: float
    cache_write_long: float
    output: float = 0.0

    def __post_init__(self) -> None:
        for name in ("input", "cache_read", "cache_write", "cache_write_long", "output"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidInputError(f"price {name} must be a non-negative number, got {value!r}")


def _openai(input_price: float, cached: float, output: float) -> Price:
    return Price(input_price, cached, input_price, input_price, output)  # OpenAI bills a write as plain input


def _anthropic(input_price: float, output: float) -> Price:
    # Anthropic's multipliers on the base input price: write 1.25x (five minutes), 2x (one hour), read 0.1x
    return Price(input_price, input_price * 0.1, input_price * 1.25, input_price * 2.0, output)


DEFAULT_PRICES: Mapping[str, Price] = {
    "gpt-4o": _openai(2.50, 1.25, 10.0),
    "gpt-4.1": _openai(2.00, 0.50, 8.0),
    "gpt-4.1-mini": _openai(0.40, 0.10, 1.6),
    "gpt-5": _openai(1.25, 0.125, 10.0),
    "gpt-5-mini": _openai(0.25, 0.025, 2.0),
    "gpt-5.4": _openai(2.50, 0.25, 15.0),
    "gpt-5.4-mini": _openai(0.75, 0.075, 4.5),
    "claude-opus-4-5": _anthropic(5.0, 25.0),
    "claude-sonnet-4": _anthropic(3.0, 15.0),
    "claude-sonnet-4-5": _anthropic(3.0, 15.0),
    "claude-haiku-4-5": _anthropic(1.0, 5.0),
}


@dataclass(frozen=True, slots=True)
class HostedUsage:
    """The token counts of one call, as the provider reported them.

    Attributes:
        input_tokens: every input token of the prompt (read + written + uncached).
        cache_read_tokens: input tokens read from the prompt cache.
        cache_write_tokens: input tokens written to the cache with the default lifetime.
        cache_write_long_tokens: input tokens written with the long lifetime.
        output_tokens: answer tokens.
    """

    input_tokens: int
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_long_tokens: int = 0
    output_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        """Input tokens neither read from nor written to the cache."""
        return max(0, self.input_tokens - self.cache_read_tokens - self.cache_write_tokens
                   - self.cache_write_long_tokens)

    def input_cost(self, price: Price) -> float:
        """The estimated input cost of this call under ``price`` (currency units, not per million). O(1)."""
        return (self.uncached_tokens * price.input + self.cache_read_tokens * price.cache_read
                + self.cache_write_tokens * price.cache_write
                + self.cache_write_long_tokens * price.cache_write_long) / PER_TOKENS

    def as_dict(self, price: Price | None) -> dict[str, Any]:
        """The fields a turn reports (the proxy's ``cpmemory.hosted``, the facade's ``HostedTurn``)."""
        return {
            "input_tokens": self.input_tokens, "cached_input_tokens": self.cache_read_tokens,
            "cache_write_tokens": self.cache_write_tokens + self.cache_write_long_tokens,
            "uncached_input_tokens": self.uncached_tokens, "output_tokens": self.output_tokens,
            "estimated_input_cost": None if price is None else round(self.input_cost(price), 9),
        }


def _count(usage: Mapping[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def parse_hosted_usage(usage: Any) -> HostedUsage:
    """A :class:`HostedUsage` from an OpenAI (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``) or an
    Anthropic (``input_tokens``, ``cache_creation_input_tokens``, ``cache_read_input_tokens``, ``cache_creation``
    by lifetime) usage object; missing or malformed counts read as 0. Pure."""
    if not isinstance(usage, Mapping):
        return HostedUsage(0)
    if "prompt_tokens" in usage and "cache_read_input_tokens" not in usage:
        details = usage.get("prompt_tokens_details")
        cached = _count(details, "cached_tokens") if isinstance(details, Mapping) else 0
        return HostedUsage(_count(usage, "prompt_tokens"), cached, 0, 0, _count(usage, "completion_tokens"))
    read, written = _count(usage, "cache_read_input_tokens"), _count(usage, "cache_creation_input_tokens")
    by_lifetime = usage.get("cache_creation")
    long_written = _count(by_lifetime, "ephemeral_1h_input_tokens") if isinstance(by_lifetime, Mapping) else 0
    long_written = min(long_written, written)
    if "prompt_tokens" in usage:  # the OpenAI-shaped usage the hosted transport returns (it keeps both)
        total = _count(usage, "prompt_tokens")
        output = _count(usage, "completion_tokens")
    else:
        total = _count(usage, "input_tokens") + read + written
        output = _count(usage, "output_tokens")
    return HostedUsage(total, read, written - long_written, long_written, output)


class PriceTable:
    """Model name -> :class:`Price`; a name matches its longest listed prefix (``claude-sonnet-4-5-20250929``
    finds ``claude-sonnet-4-5``). Immutable: :meth:`with_overrides` returns a new table."""

    def __init__(self, prices: Mapping[str, Price] | None = None) -> None:
        self._prices = dict(DEFAULT_PRICES if prices is None else prices)

    def with_overrides(self, overrides: Mapping[str, Price | Mapping[str, float]]) -> PriceTable:
        """A table with ``overrides`` (a Price, or the fields to change of the listed one) applied. Raises
        InvalidInputError for a partial override of an unlisted model or a bad field."""
        merged = dict(self._prices)
        for model, override in overrides.items():
            if isinstance(override, Price):
                merged[model] = override
                continue
            base = self.find(model)
            fields = dict(override)
            if base is None:
                try:
                    merged[model] = Price(**fields)
                except TypeError as error:
                    raise InvalidInputError(f"price of {model!r}: {error}") from error
                continue
            try:
                merged[model] = replace(base, **fields)
            except TypeError as error:
                raise InvalidInputError(f"price of {model!r}: {error}") from error
        return PriceTable(merged)

    def find(self, model: str) -> Price | None:
        """The price of ``model`` (longest listed prefix), None when unlisted. O(number of models)."""
        best = ""
        for name in self._prices:
            if model.startswith(name) and len(name) > len(best):
                best = name
        return self._prices.get(best) if best else None

    def models(self) -> list[str]:
        """The listed model names."""
        return sorted(self._prices)


@dataclass(slots=True)
class UsageTotals:
    """Running totals over calls (mutable; one per transport or chat). ``add`` is O(1)."""

    calls: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    estimated_input_cost: float = 0.0

    def add(self, usage: HostedUsage, price: Price | None) -> None:
        """Count one call."""
        self.calls += 1
        self.input_tokens += usage.input_tokens
        self.cached_input_tokens += usage.cache_read_tokens
        self.cache_write_tokens += usage.cache_write_tokens + usage.cache_write_long_tokens
        self.output_tokens += usage.output_tokens
        if price is not None:
            self.estimated_input_cost += usage.input_cost(price)
