"""The proxy's configuration: one tree of pydantic models, the one place of every default and cross-field rule.

::

    ServerConfig
    ├── memory: CpMemoryConfig          the facade's tunables (dedup, index, history, budget)
    ├── redis: RedisStoreConfig         key prefix, timeouts, TTL of the Redis session store (with ``redis_url``)
    ├── router: RouterConfig            routing policy and thresholds
    ├── hold: HoldConfig                the hold queue: ``off | window | pick`` (cpmemory.server.hold)
    ├── fit: FitConfig                  cache-fit admission (cpmemory.server.fit)
    └── experimental: ExperimentalConfig  ablations the benchmarks set; never on the command line

``cpmemory serve`` builds it from its flags over a ``--config`` file (cpmemory.server.config_file), and ``cpmemory
bench serve`` builds its in-process proxy from the same tree. The reference of every field is generated from the
descriptions here (``docs/reference/serve.md``, ``python -m cpmemory.server.reference``).

Hold policies and what each one sets unless the ``hold`` section says otherwise (:data:`HOLD_DEFAULTS`):

=========  ==================  ============  ========  ==================================================
policy     count per replica   token bound   timeout   for
=========  ==================  ============  ========  ==================================================
off        -                   -             -         chats, agents, a closed loop of a few clients
window     none                on            100 ms    bursts: an evaluation, a fan-out of agents
pick       1                   off           60 s      open-loop arrivals above what the replicas serve
=========  ==================  ============  ========  ==================================================

Gateway presets (``upstream_kind``; ``upstream_session`` and ``cache_salt`` override them, :data:`UPSTREAM_PRESETS`):
``vllm-router`` names each conversation to the gateway (its session affinity) and, on a single-tenant proxy, sends
no cache salt (its ``kv_aware`` policy routes salted requests by load alone); ``llm-d``, ``sglang`` and ``generic``
send salts and name nothing (SGLang gives ``session_params`` a meaning of its own).

``cache_salt_secret`` has no public default: give one (``CPMEMORY_CACHE_SALT_SECRET``), or let the proxy generate
one on first start and keep it in Redis (every worker on the same prefix shares it). Without Redis, API keys
(tenants) require a given secret; a single-tenant proxy without Redis uses a per-process secret.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from cpmemory.hosted.provider import HostedSettings
from cpmemory.routing.router import RouterConfig
from cpmemory.session.config import CpMemoryConfig
from cpmemory.stores.redis_store import RedisStoreConfig

SERVER_REDIS = RedisStoreConfig(socket_timeout_s=1.0, connect_timeout_s=1.0)
"""The proxy's Redis defaults: longer timeouts than the library's (the proxy shares its loop with many clients)."""
MAX_BODY_BYTES = 8 * 1024 * 1024
"""The largest request body the proxy reads by default (``max_body_bytes``); a larger one is answered 413."""
HOLD_MS_MAX = 60_000.0
"""The longest hold timeout allowed: a minute (seconds of hold pay only under sustained overload)."""

HoldPolicy = Literal["off", "window", "pick"]
UpstreamKind = Literal["generic", "vllm-router", "llm-d", "sglang"]


@dataclass(frozen=True, slots=True)
class HoldSettings:
    """A hold policy's effective bounds (:meth:`HoldConfig.settings`).

    Attributes:
        max_in_flight: requests one replica runs at once before arrivals are held; None: no count bound.
        token_bound: hold while the estimated prompt tokens in flight fill the replicas' KV caches.
        timeout_s: the longest a request is held.
    """

    max_in_flight: int | None
    token_bound: bool
    timeout_s: float


HOLD_DEFAULTS: dict[HoldPolicy, HoldSettings] = {
    "window": HoldSettings(max_in_flight=None, token_bound=True, timeout_s=0.1),
    "pick": HoldSettings(max_in_flight=1, token_bound=False, timeout_s=60.0),
}
"""What each hold policy sets unless the ``hold`` section says otherwise. ``window``: the token bound needs no
setting (the cache sizes come from the engines), and a short timeout gathers a burst. ``pick``: a replica is free
when it runs none of the pick's requests (with the token share alone the pick cached less than windows); a long
timeout, because each held request is placed as soon as a replica frees."""


@dataclass(frozen=True, slots=True)
class UpstreamPreset:
    """What a gateway kind implies: name conversations to it (session affinity), send tenant cache salts."""

    session: bool
    cache_salt: bool


UPSTREAM_PRESETS: dict[UpstreamKind, UpstreamPreset] = {
    "generic": UpstreamPreset(session=False, cache_salt=True),
    "vllm-router": UpstreamPreset(session=True, cache_salt=False),
    "llm-d": UpstreamPreset(session=False, cache_salt=True),
    "sglang": UpstreamPreset(session=False, cache_salt=True),
}
"""Per gateway kind. A preset's ``cache_salt=False`` applies to a single-tenant proxy only: with API keys the salts
stay on (they keep tenants' KV blocks apart)."""


class HoldConfig(BaseModel):
    """The hold queue (cpmemory.server.hold): requests that arrive while the replicas are full are held and released
    in the window planner's order. Unset bounds take the policy's defaults (:data:`HOLD_DEFAULTS`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: HoldPolicy = Field(
        default="off", description="off: nothing is held; window: release every held request together in the "
        "planner's order when a request ends or the oldest waited the timeout; pick: a replica with room takes one "
        "held request at a time, the rest of the planned run it serves, else the one it caches the longest prefix of")
    max_in_flight: int | None = Field(
        default=None, ge=1, description="requests one replica runs at once (vLLM's --max-num-seqs) before arrivals "
        "are held; unset: the policy's default")
    token_bound: bool | None = Field(
        default=None, description="hold while the estimated prompt tokens in flight fill the replicas' KV caches; "
        "unset: the policy's default")
    timeout_ms: float | None = Field(
        default=None, gt=0, le=HOLD_MS_MAX, description="the longest a request is held, in milliseconds; unset: the "
        "policy's default")

    def settings(self) -> HoldSettings | None:
        """The effective bounds: the policy's defaults with the given fields over them; None when the hold is off."""
        if self.policy == "off":
            return None
        base = HOLD_DEFAULTS[self.policy]
        return HoldSettings(
            max_in_flight=self.max_in_flight if self.max_in_flight is not None else base.max_in_flight,
            token_bound=self.token_bound if self.token_bound is not None else base.token_bound,
            timeout_s=self.timeout_ms / 1000.0 if self.timeout_ms is not None else base.timeout_s)


class FitConfig(BaseModel):
    """Cache-fit admission (cpmemory.server.fit): a replica takes a new conversation only while the conversations it
    serves fit its KV cache; the others wait, first come first served."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=True, description="on where the replicas' KV cache sizes are known")
    fill: float = Field(default=0.9, gt=0, le=1, description="the share of a replica's KV cache live conversations "
                        "may take (about 0.9 / K with K proxy workers in front of the same replicas)")
    idle_ms: float = Field(default=500.0, ge=0, le=600_000, description="a conversation with nothing in flight "
                           "this long stops holding its share (the longest learnt idle window)")
    first_idle_ms: float = Field(default=500.0, ge=0, le=600_000, description="the same for a conversation that has "
                                 "had one turn so far")
    grace_ms: float = Field(default=100.0, ge=0, le=600_000, description="a replica with nothing in flight this "
                            "long (and the idle window) takes the next new conversation anyway")
    max_wait_s: float = Field(default=30.0, gt=0, le=3600, description="the longest a turn waits for room; then it "
                              "is sent to its replica anyway")


class ExperimentalConfig(BaseModel):
    """Ablations: parts of admission the benchmarks turn off to measure them. Set in a config file or by a
    benchmark, never on the command line; each is on in the product."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hold_split: bool = Field(default=True, description="split a held window that outgrows the replicas' caches over "
                             "them (one contiguous run of the planned order per replica); off: the router places "
                             "each released request")
    fit_move: bool = Field(default=True, description="a live conversation whose history no longer fits its replica "
                           "moves to a replica with room rather than wait")
    fit_learn_idle: bool = Field(default=True, description="the idle window shrinks to 1.25 times the longest recent "
                                 "gap between an answer and its conversation's next turn; off: always fit.idle_ms")


class ServerConfig(BaseModel):
    """Configuration of one proxy. Every field's description is its reference (docs/reference/serve.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engines: list[str] = Field(default_factory=list, description="base URLs of the engine replicas "
                               "(OpenAI-compatible, e.g. vLLM); behind a gateway, the replicas behind it (for "
                               "/tokenize, cache sizes and, with kv_events, which replica served a turn)")
    upstream: str | None = Field(default=None, description="a gateway (vllm-router, llm-d, an SGLang router) that "
                                 "picks the replica: every call goes there")
    upstream_kind: UpstreamKind = Field(default="generic", description="the gateway's kind: its preset of "
                                        "upstream_session and cache_salt")
    upstream_session: bool = Field(default=False, description="each turn names its conversation to the gateway "
                                   "(session_params.session_id) so one with session affinity keeps its turns on one "
                                   "replica; default: the upstream_kind's preset")
    cache_salt: bool = Field(default=True, description="send each tenant's vLLM cache_salt (keeps tenants' KV blocks "
                             "apart); off only on a single-tenant proxy; default: the upstream_kind's preset")
    kv_events: list[str] = Field(default_factory=list, description="vLLM KV-event endpoint (tcp://HOST:PORT) of each "
                                 "engine, in engines order: eviction sync and the router's view of each cache")
    tokenizer: str | None = Field(default=None, description="the served model's tokenizer (directory or Hugging Face "
                                  "id; 'auto': the engine's own when it loads here): prompts are tokenized in the "
                                  "proxy instead of by each engine's /tokenize")
    redis_url: str | None = Field(default=None, description="session store (redis://HOST:PORT/DB, or "
                                  "redis+cluster://HOST:PORT); unset: process memory, lost on restart")
    redis: RedisStoreConfig = Field(default=SERVER_REDIS, description="the Redis store's key prefix, timeouts, TTL")
    memory: CpMemoryConfig = Field(default_factory=CpMemoryConfig, description="the facade's settings")
    api_keys: dict[str, str] = Field(default_factory=dict, description="API key -> tenant (a secret: give it by "
                                     "CPMEMORY_API_KEYS or a keys file); empty: every caller is tenant 'default'")
    cache_salt_secret: SecretStr | None = Field(default=None, description="key of the per-tenant cache salts, 16+ "
                                                "characters (a secret: CPMEMORY_CACHE_SALT_SECRET); unset: generated "
                                                "and kept in Redis, or per process")
    engine_timeout_s: float = Field(default=120.0, gt=0, description="per-call engine timeout; past it the replica "
                                    "is marked down and the call fails over")
    router: RouterConfig = Field(default_factory=RouterConfig, description="routing policy and thresholds")
    replica_cache_tokens: int = Field(default=1_000_000, ge=0, description="each replica's KV cache in tokens when "
                                      "the engines report none (the router's view of what was sent where)")
    prompt_budget: bool = Field(default=True, description="fit every turn's prompt to the engine's max_model_len "
                                "minus the request's max_tokens")
    answer_reserve_tokens: int = Field(default=1024, ge=1, description="answer tokens reserved for a request that "
                                       "gives no max_tokens")
    engine_priority: bool = Field(default=False, description="each engine request carries vLLM's priority: the "
                                  "prompt tokens its replica must still compute (start vLLM with "
                                  "--scheduling-policy priority; SGLang serves higher values first)")
    hold: HoldConfig = Field(default_factory=HoldConfig, description="the hold queue")
    fit: FitConfig = Field(default_factory=FitConfig, description="cache-fit admission")
    experimental: ExperimentalConfig = Field(default_factory=ExperimentalConfig, description="ablations")
    max_body_bytes: int = Field(default=MAX_BODY_BYTES, ge=1024, description="larger request bodies get 413")
    hosted: HostedSettings | None = Field(default=None, description="send to a hosted provider (cpmemory.hosted)")

    @model_validator(mode="before")
    @classmethod
    def _apply_upstream_preset(cls, data: Any) -> Any:
        """Fill ``upstream_session`` and ``cache_salt`` from the ``upstream_kind`` preset where they are not given."""
        if not isinstance(data, dict):
            return data
        filled = {key: value for key, value in data.items()
                  if value is not None or key not in ("upstream_session", "cache_salt")}
        preset = UPSTREAM_PRESETS.get(filled.get("upstream_kind", "generic"))
        if filled.get("upstream") is None or preset is None:
            return filled  # no gateway (the fields' defaults), or an unknown kind (its validation reports it)
        if filled.get("upstream_session") is None:
            filled["upstream_session"] = preset.session
        if filled.get("cache_salt") is None:
            filled["cache_salt"] = preset.cache_salt or bool(filled.get("api_keys"))
        return filled

    @field_validator("cache_salt_secret")
    @classmethod
    def _strong_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None  # empty (e.g. an unset environment variable in compose): generated, see the module
        if len(value.get_secret_value()) < 16:
            raise ValueError("cache_salt_secret must have at least 16 characters")
        return value

    @property
    def attributes_gateway(self) -> bool:
        """Behind a gateway whose replicas' KV events are given: the proxy learns which replica served each turn."""
        return self.upstream is not None and bool(self.kv_events)

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        """Every cross-field rule of the proxy's configuration (``serve`` and ``bench serve`` share them)."""
        if not self.engines and self.upstream is None:
            raise ValueError("give at least one engine, or an upstream gateway")
        if self.kv_events and len(self.kv_events) != len(self.engines):
            raise ValueError("give one KV-event endpoint per engine, in the same order")
        if self.upstream is None and (self.upstream_session or self.upstream_kind != "generic"):
            raise ValueError("upstream_kind and upstream_session describe a gateway: each needs an upstream")
        if self.api_keys and not self.cache_salt:
            raise ValueError("cache salts keep tenants' KV caches apart: they can be turned off only on a "
                             "single-tenant proxy (no api_keys)")
        if self.api_keys and self.cache_salt_secret is None and self.redis_url is None:
            raise ValueError("tenants (api_keys) need a cache_salt_secret (or a redis_url to keep a generated one)")
        self._check_hold()
        return self

    def _check_hold(self) -> None:
        hold = self.hold
        settings = hold.settings()
        if settings is None:
            if hold.max_in_flight is not None or hold.token_bound is not None or hold.timeout_ms is not None:
                raise ValueError("hold bounds need a hold policy: set hold.policy to window or pick")
            return
        if settings.max_in_flight is None and not settings.token_bound:
            raise ValueError("a hold needs a bound: hold.max_in_flight, hold.token_bound or both")
        if hold.policy == "pick" and self.upstream is not None:
            raise ValueError("the pick places held requests on the proxy's own replicas as each one frees: it cannot "
                             "run behind an upstream gateway")
