"""One hosted provider as sans-IO code: the HTTP request for an OpenAI-style chat body, and the OpenAI-style
answer and :class:`~cpmemory.hosted.prices.HostedUsage` of its response. The facade path
(:class:`cpmemory.hosted.chat.HostedChat`) and the proxy's upstream (:class:`cpmemory.hosted.transport.HostedTransport`)
both send what this builds; neither knows a provider's format.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from cpmemory.errors import InvalidInputError
from cpmemory.hosted.anthropic_body import (
    CPMEMORY_PLACEMENT,
    anthropic_request,
    count_breakpoints,
    openai_response,
)
from cpmemory.hosted.openai_body import openai_request
from cpmemory.hosted.prices import HostedUsage, Price, PriceTable, parse_hosted_usage

__all__ = ["DEFAULT_BASE_URLS", "HostedProvider", "HostedRequest", "HostedSettings"]

DEFAULT_BASE_URLS = {"openai": "https://api.openai.com/v1", "anthropic": "https://api.anthropic.com"}
ANTHROPIC_VERSION = "2023-06-01"
API_KEY_VARIABLE = "CPMEMORY_HOSTED_API_KEY"


class HostedSettings(BaseModel):
    """Which hosted provider to send to, and how (the ``hosted`` section of the proxy's configuration).

    Attributes:
        provider: ``openai`` (Chat Completions) or ``anthropic`` (Messages).
        base_url: the API root (default: the provider's public endpoint; a compatible gateway's root otherwise).
        api_key: the provider's key (sent as ``Authorization: Bearer`` or ``x-api-key``); None reads
            ``CPMEMORY_HOSTED_API_KEY`` when the provider object is made.
        model: replaces the model a client names (None: the client's model is sent).
        prompt_cache_key: OpenAI: send a stable ``prompt_cache_key`` (per conversation, else per shared prefix).
        placement: Anthropic: where ``cache_control`` breakpoints go (``cpmemory.hosted.anthropic_body``).
        ttl: Anthropic: the cache lifetime of the breakpoints (``5m`` or ``1h``; None: the provider's default).
        max_tokens: Anthropic: ``max_tokens`` of a request that names none (the Messages API requires one).
        prices: per-model price overrides (model -> fields of :class:`~cpmemory.hosted.prices.Price`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    provider: Literal["openai", "anthropic"]
    base_url: str | None = None
    api_key: SecretStr | None = None
    model: str | None = None
    prompt_cache_key: bool = True
    placement: tuple[str, ...] = CPMEMORY_PLACEMENT
    ttl: Literal["5m", "1h"] | None = None
    max_tokens: int = Field(default=1024, ge=1)
    prices: dict[str, dict[str, float]] = Field(default_factory=dict)

    @field_validator("placement")
    @classmethod
    def _known_placement(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [name for name in value if name not in CPMEMORY_PLACEMENT]
        if unknown:
            raise ValueError(f"unknown breakpoint placement {unknown}; choose from {list(CPMEMORY_PLACEMENT)}")
        return value

    @property
    def root(self) -> str:
        """The API root requests go to."""
        return (self.base_url or DEFAULT_BASE_URLS[self.provider]).rstrip("/")


@dataclass(frozen=True, slots=True)
class HostedRequest:
    """One HTTP request to the provider: where, with which headers, which JSON body, how many breakpoints."""

    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    breakpoints: int = 0


class HostedProvider:
    """Requests and answers of one provider (immutable; no IO)."""

    def __init__(self, settings: HostedSettings, prices: PriceTable | None = None) -> None:
        """No IO; a settings object without ``api_key`` takes ``CPMEMORY_HOSTED_API_KEY`` from the environment
        now (so a config file need not hold the secret)."""
        if settings.api_key is None and os.environ.get(API_KEY_VARIABLE):
            settings = settings.model_copy(update={"api_key": SecretStr(os.environ[API_KEY_VARIABLE])})
        self.settings = settings
        self.prices = (prices or PriceTable()).with_overrides(settings.prices)

    @property
    def name(self) -> str:
        return self.settings.provider

    def request(self, body: Mapping[str, Any], *, cache_key: str | None = None) -> HostedRequest:
        """The request for an OpenAI-style chat ``body``.

        Args:
            body: the chat completion body (messages, model, options); a stream asks for usage too.
            cache_key: OpenAI's ``prompt_cache_key`` (a conversation's key); None derives it from the prompt's
                shared prefix. Ignored with ``prompt_cache_key`` off, and by Anthropic.

        Raises:
            InvalidInputError: the body cannot be translated (Anthropic: tools, non-text content, n > 1).
        """
        settings = self.settings
        key = settings.api_key.get_secret_value() if settings.api_key is not None else ""
        if settings.provider == "openai":
            out = dict(body)
            if settings.prompt_cache_key:
                out = openai_request(out, cache_key=cache_key, model=settings.model)
            else:
                out = {name: value for name, value in openai_request(out, model=settings.model).items()
                       if name != "prompt_cache_key" or "prompt_cache_key" in body}
            headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
            return HostedRequest(f"{settings.root}/chat/completions", headers, out)
        translated = anthropic_request({name: value for name, value in body.items() if name != "stream"},
                                       model=settings.model, placement=settings.placement, ttl=settings.ttl,
                                       default_max_tokens=settings.max_tokens)
        if body.get("stream") is True:
            translated["stream"] = True
        if not translated.get("model"):
            raise InvalidInputError("a model is required (the request's or HostedSettings.model)")
        headers = {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"}
        return HostedRequest(f"{settings.root}/v1/messages", headers, translated, count_breakpoints(translated))

    def response(self, payload: Mapping[str, Any], *, created: int) -> tuple[dict[str, Any], HostedUsage]:
        """The OpenAI-style chat completion of a provider's answer and its usage. Pure."""
        if self.settings.provider == "openai":
            answer = dict(payload)
        else:
            answer = openai_response(payload, created=created)
        return answer, parse_hosted_usage(answer.get("usage"))

    def price(self, model: str) -> Price | None:
        """The price of ``model`` (None: unlisted; the cost is then reported as None)."""
        return self.prices.find(model)

    def turn_info(self, usage: HostedUsage, model: str, breakpoints: int = 0) -> dict[str, Any]:
        """What a turn reports about the provider's cache: tokens by kind and the estimated input cost."""
        info = {"provider": self.name, "model": model, **usage.as_dict(self.price(model))}
        if self.name == "anthropic":
            info["breakpoints"] = breakpoints
        return info
