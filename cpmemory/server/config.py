"""The proxy's configuration: one tree of pydantic models (``cpmemory serve`` takes its defaults from here).

::

    ServerConfig
    ├── memory: CpMemoryConfig        the facade's tunables (dedup, index, history, budget)
    ├── redis: RedisStoreConfig       key prefix, timeouts, TTL of the Redis session store (with ``redis_url``)
    └── router: RouterConfig          routing policy and thresholds

``cache_salt_secret`` has no public default: give one (``--cache-salt-secret`` / ``CPM_CACHE_SALT_SECRET``), or
let the proxy generate one on first start and keep it in Redis (every worker on the same prefix shares it). Without
Redis, API keys (tenants) require a given secret; a single-tenant proxy without Redis uses a per-process secret.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from cpmemory.hosted.provider import HostedSettings
from cpmemory.routing.router import RouterConfig
from cpmemory.session.config import CpMemoryConfig
from cpmemory.stores.redis_store import RedisStoreConfig

SERVER_REDIS = RedisStoreConfig(socket_timeout_s=1.0, connect_timeout_s=1.0)
MAX_BODY_BYTES = 8 * 1024 * 1024
"""The largest request body the proxy reads by default (``max_body_bytes``); a larger one is answered 413."""
HOLD_MS_MAX = 60_000.0
"""The longest ``hold_ms`` allowed: a minute (seconds of hold pay only under sustained overload)."""
"""The proxy's Redis defaults: longer timeouts than the library's (the proxy shares its loop with many clients)."""


class ServerConfig(BaseModel):
    """Configuration of one proxy.

    Attributes:
        engines: base URLs of the engine replicas (OpenAI-compatible, e.g. vLLM).
        redis_url: session store; None keeps state in process memory (lost on restart). ``redis://HOST:PORT/DB``
            for one server, ``redis+cluster://HOST:PORT`` for a Redis Cluster (cpmemory.server.store_setup).
        redis: the Redis store's settings (prefix: one per deployment; timeouts; TTL).
        memory: the facade's settings.
        api_keys: API key -> tenant. Empty: every caller is the single tenant ``default``.
        cache_salt_secret: key of the hash that derives each tenant's vLLM ``cache_salt`` (see the module).
        cache_salt: send the tenant's ``cache_salt`` with every request (the default). Off (a single-tenant proxy
            only: salts are what keep tenants' KV blocks apart) the proxy adds none, so a gateway that cannot
            prefix-route salted requests (vllm-router's ``kv_aware`` routes them by load alone) can route these.
        engine_timeout_s: per-call engine timeout; past it the replica is marked down and the call fails over.
        router: routing policy and thresholds (prefix-aware by default).
        kv_events: vLLM KV-event endpoints (``tcp://host:port``), one per engine, for eviction sync (and, when not
            behind a gateway, for the router's view of what each replica caches).
        upstream_session: behind a gateway, each turn's body carries ``session_params.session_id`` (a digest of its
            conversation's key), so a gateway with session affinity keeps a conversation's turns on the replica that
            holds its history (vllm-router: ``--kv-aware-session-affinity-ttl-secs``). Off by default: engines that
            give ``session_params`` a meaning of their own (SGLang's sessions) must not receive it.
        tokenizer: the served model's tokenizer (directory or Hugging Face id): the proxy tokenizes prompts itself
            (``cpmemory.engines.local_tokenizer``) instead of asking each engine's ``/tokenize``. ``"auto"``: the
            engine's own, when the model its ``/v1/models`` names loads here without a download and tokenizes a
            probe chat exactly as its ``/tokenize`` (``cpmemory.engines.local_tokenizer.discover``); until then, and
            otherwise, each engine's ``/tokenize``.
        upstream: a gateway (vllm-router, llm-d, an SGLang router) that picks the replica; every call goes there.
            ``engines`` are then the replicas behind it, used only for ``/tokenize``, cache config and, with
            ``kv_events``, to find out which replica served each turn (eviction sync there, and cache-fit admission
            per replica: :attr:`attributes_gateway`); they may be left empty without ``kv_events``.
        replica_cache_tokens: each replica's cache size in tokens, for the router's view of what was sent where
            (used when the replicas publish no KV events).
        prompt_budget: fit every cpmemory turn's prompt to the engine: ``max_model_len`` (``/v1/models``) minus the
            request's ``max_tokens``, counted by the engine's ``/tokenize`` when offered (cpmemory.server.budget).
        answer_reserve_tokens: answer tokens reserved for a request that gives no ``max_tokens``.
        max_in_flight: requests one replica can run at once (vLLM's ``--max-num-seqs``); while the proxy has that
            many per healthy replica in flight, arriving requests are held and released together in the window
            planner's order (cpmemory.server.hold). None (the default): no count bound; nothing is held unless ``hold_fit``.
        hold_ms: the longest a request is held (milliseconds, at most one minute). Short (the default) gathers the
            requests that arrive together; long (seconds) turns the queue of a fleet under sustained overload into
            planned windows, and holds requests a replica could have run when it is not overloaded.
        hold_fit: the hold queue's token bound: while the requests in flight (their prompts' estimated tokens) fill
            the replicas' KV caches together (read from the engines' ``/metrics``, else ``replica_cache_tokens`` when
            given), arriving requests are held, as a vLLM replica would queue them. Needs no ``max_in_flight``
            (with it, both bounds hold); no token bound while no cache size is known.
        hold_split: a held window that outgrows the replicas' caches is split over them (one contiguous run of the
            planned order per replica, even in prefill work, each run in shortest-mean-work order; cpmemory.server.hold);
            off: the router places each released request.
        hold_pick: instead of releasing every held request as one window, a replica with room (fewer than
            ``max_in_flight`` of the pick's requests; with ``hold_fit`` also its share of the caches) takes one held
            request at a time: one of the split plan's run it serves, else the one whose planned block order finds
            the longest prefix in what the proxy sent that replica (cpmemory.server.hold, ``HoldQueue._pick``).
            Needs ``max_in_flight`` (what makes a replica free: with ``hold_fit``'s token share alone the pick
            cached less than windows, docs/bench-serve.md "Measured 2026-12-07 (twenty-fourth machine ...)") and
            the proxy's own router (no ``upstream``).
        fit: cache-fit admission (cpmemory.server.fit): a replica takes a new conversation only while the
            conversations it serves fit its KV cache (read from each engine's ``/metrics``, else
            ``replica_cache_tokens`` when given); the others wait, first come first served. Off where no size is known.
        fit_fill: the share of a replica's KV cache the live conversations may take.
        fit_idle_ms: a conversation with nothing in flight for this long stops holding its share (the longest,
            with ``fit_learn_idle``).
        fit_learn_idle: the idle windows shrink to 1.25 times the longest recent gap between a turn's answer and its
            conversation's next turn (``CacheFit.idle_window_s``); off: always ``fit_idle_ms``.
        fit_move: a live conversation whose history no longer fits its replica's cache moves to a replica with room
            for it rather than wait there (``CacheFit``, "moved").
        engine_priority: each engine request carries vLLM's ``priority`` (lower is served first): the prompt tokens
            its replica must still compute by the router's view (``cpmemory.routing.dispatch.engine_priority``), so
            a replica's queue serves the requests it mostly caches first and their prefixes are used before later
            prompts evict them. The engines need ``--scheduling-policy priority`` (vLLM's V1 engine ignores the
            field without it). Off by default: SGLang serves *higher* values first unless started with
            ``--schedule-low-priority-values-first``, and vLLM's V0 engine refused a priority without the policy.
            A request that sets its own ``priority`` keeps it.
        max_body_bytes: the largest request body read; a larger one is answered 413 (cpmemory.server.responses).
        fit_first_idle_ms: the same for a conversation that has had one turn so far (a lone question frees it soon).
        fit_grace_ms: a replica with nothing in flight for this long (and for the idle window) takes the next new
            conversation anyway.
        fit_max_wait_s: the longest a turn waits for room (then it goes to the router's choice anyway).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    engines: list[str] = Field(default_factory=list)
    redis_url: str | None = None
    redis: RedisStoreConfig = SERVER_REDIS
    memory: CpMemoryConfig = Field(default_factory=CpMemoryConfig)
    api_keys: dict[str, str] = Field(default_factory=dict)
    cache_salt_secret: SecretStr | None = None
    cache_salt: bool = True
    engine_timeout_s: float = Field(default=120.0, gt=0)
    router: RouterConfig = Field(default_factory=RouterConfig)
    kv_events: list[str] = Field(default_factory=list, description="KV-event endpoint per engine, in order")
    tokenizer: str | None = Field(default=None, description="the served model's tokenizer (path, HF id or auto)")
    upstream: str | None = Field(default=None, description="a gateway that picks the replica")
    upstream_session: bool = Field(default=False, description="name each conversation to the gateway")
    replica_cache_tokens: int = Field(default=1_000_000, ge=0, description="per replica, for the sent view")
    prompt_budget: bool = True
    answer_reserve_tokens: int = Field(default=1024, ge=1)
    max_in_flight: int | None = Field(default=None, ge=1, description="per replica; None: the hold queue is off")
    hold_ms: float = Field(default=5.0, gt=0, le=HOLD_MS_MAX, description="the longest a request is held")
    hold_split: bool = Field(default=True, description="split a held window that outgrows the caches over replicas")
    hold_fit: bool = Field(default=False, description="hold while the requests in flight fill the replicas' KV caches")
    hold_pick: bool = Field(default=False, description="a replica with room takes the held request it caches most of")
    fit: bool = True
    fit_fill: float = Field(default=0.9, gt=0, le=1)
    fit_idle_ms: float = Field(default=500.0, ge=0, le=600_000)
    fit_first_idle_ms: float = Field(default=500.0, ge=0, le=600_000)
    fit_learn_idle: bool = True
    fit_move: bool = True
    fit_grace_ms: float = Field(default=100.0, ge=0, le=600_000)
    fit_max_wait_s: float = Field(default=30.0, gt=0, le=3600)
    engine_priority: bool = False
    max_body_bytes: int = Field(default=MAX_BODY_BYTES, ge=1024, description="larger request bodies get 413")
    hosted: HostedSettings | None = Field(default=None, description="send to a hosted provider (cpmemory.hosted)")

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
    def _check_targets(self) -> ServerConfig:
        if not self.engines and self.upstream is None:
            raise ValueError("give at least one engine, or an upstream gateway")
        if self.kv_events and len(self.kv_events) != len(self.engines):
            raise ValueError("give one KV-event endpoint per engine, in the same order")
        if self.upstream_session and self.upstream is None:
            raise ValueError("upstream_session names conversations to a gateway: it needs an upstream")
        if self.hold_pick and (self.upstream is not None or self.max_in_flight is None):
            raise ValueError("hold_pick places held requests on the proxy's own replicas as each one frees: it needs "
                             "max_in_flight (a replica's count) and no upstream gateway")
        if self.api_keys and not self.cache_salt:
            raise ValueError("cache salts keep tenants' KV caches apart: they can be turned off only on a "
                             "single-tenant proxy (no api_keys)")
        if self.api_keys and self.cache_salt_secret is None and self.redis_url is None:
            raise ValueError("tenants (api_keys) need a cache_salt_secret (or a redis_url to keep a generated one)")
        return self
