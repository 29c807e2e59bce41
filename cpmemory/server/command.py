"""``cpmemory serve``: start the OpenAI-compatible proxy in front of one or more engine replicas (uvicorn).

Example::

    cpmemory serve --engine http://127.0.0.1:8000 --engine http://127.0.0.1:8001 --redis redis://127.0.0.1:6379/0

Behind a gateway that picks the replica (vllm-router, llm-d, an SGLang router)::

    cpmemory serve --upstream http://127.0.0.1:18120 \
        --engine http://127.0.0.1:18110 --kv-events tcp://127.0.0.1:15610 \
        --engine http://127.0.0.1:18111 --kv-events tcp://127.0.0.1:15611

(the engines and their KV events are then only followed for evictions; without ``--kv-events`` they may be left out).

API keys map to tenants: ``--api-key KEY=TENANT`` (repeatable) or ``--api-keys-file FILE`` (a JSON object
``{"KEY": "TENANT"}``, which keeps keys out of the process list). Without keys every caller is tenant ``default``.

``--max-in-flight N [--hold-ms MS]`` turns on the hold-and-release queue (cpmemory.server.hold). Cache-fit
admission (cpmemory.server.fit) is on by default: ``--no-fit`` turns it off, ``--fit-max-wait S`` bounds a wait,
``--fit-fill F`` sets the share of each replica's cache it fills.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cpmemory.errors import InvalidInputError, MissingDependencyError
from cpmemory.routing.router import RouterConfig
from cpmemory.server.config import HOLD_MS_MAX, SERVER_REDIS, ServerConfig
from cpmemory.server.fit import GAP_MARGIN
from cpmemory.stores.redis_store import RedisStoreConfig


def parse_api_keys(pairs: list[str], keys_file: Path | None) -> dict[str, str]:
    """Merge ``KEY=TENANT`` pairs and a JSON keys file into one mapping; raises typer.BadParameter on bad input."""
    keys: dict[str, str] = {}
    if keys_file is not None:
        try:
            loaded = json.loads(keys_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise typer.BadParameter(f"cannot read {keys_file}: {error}") from error
        if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v
                                                   for k, v in loaded.items()):
            raise typer.BadParameter("the API keys file must be a JSON object of non-empty strings")
        keys.update(loaded)
    for pair in pairs:
        key, separator, tenant = pair.partition("=")
        if not separator or not key or not tenant:
            raise typer.BadParameter(f"--api-key expects KEY=TENANT, got {pair!r}")
        keys[key] = tenant
    return keys


_FIELDS = ServerConfig.model_fields
_ROUTER_FIELDS = RouterConfig.model_fields


def command(
    engine: Annotated[list[str] | None, typer.Option(
        "--engine", help="Engine base URL (repeat for several replicas).")] = None,
    upstream: str | None = typer.Option(
        None, "--upstream", help="A gateway (vllm-router, llm-d, SGLang router) that picks the replica."),
    router_policy: str = typer.Option(_ROUTER_FIELDS["policy"].default, "--router",
                                      help="prefix (cached prefix + load), affinity (hash of the conversation) or session (least loaded, then sticky)."),
    replica_cache_tokens: int = typer.Option(
        _FIELDS["replica_cache_tokens"].default, "--replica-cache-tokens",
        help="Each replica's cache size in tokens, for the router's view when the engines publish no KV events."),
    redis: str | None = typer.Option(None, "--redis", help="Redis URL for session state (default: in memory)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    kv_events: Annotated[list[str] | None, typer.Option(
        "--kv-events", help="vLLM KV-event endpoint (tcp://HOST:PORT) of each engine, in --engine order."
    )] = None,
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", show_default=False,
        help="The served model's tokenizer (a directory or Hugging Face id; needs cpmemory[tokenizer]): prompts are "
        "tokenized in the proxy for --kv-events routing, eviction sync and the prompt budget, instead of by each "
        "engine's /tokenize. 'auto': the engine's own, when the model its /v1/models names loads here without a "
        "download and tokenizes a probe exactly as its /tokenize."),
    api_key: Annotated[list[str] | None, typer.Option("--api-key", help="KEY=TENANT (repeatable).")] = None,
    api_keys_file: Annotated[Path | None, typer.Option("--api-keys-file", help="JSON object {KEY: TENANT}.")] = None,
    redis_prefix: str = typer.Option(SERVER_REDIS.prefix, "--redis-prefix", help="Key prefix in Redis."),
    redis_timeout: float = typer.Option(SERVER_REDIS.socket_timeout_s, "--redis-timeout",
                                        help="Seconds per Redis call before a turn is served pass-through."),
    engine_timeout: float = typer.Option(_FIELDS["engine_timeout_s"].default, "--engine-timeout",
                                         help="Seconds before a replica is failed over."),
    cache_salt_secret: str | None = typer.Option(
        None, "--cache-salt-secret", envvar="CPM_CACHE_SALT_SECRET",
        help="Key of per-tenant cache salts (16+ characters). Default: generated and kept in Redis (--redis), "
        "or per process; required with API keys and no Redis.", show_default=False,
    ),
    upstream_session: bool = typer.Option(
        _FIELDS["upstream_session"].default, "--upstream-session/--no-upstream-session",
        help="With --upstream: each turn names its conversation to the gateway (session_params.session_id), so one "
        "with session affinity (vllm-router --kv-aware-session-affinity-ttl-secs) keeps its turns on one replica."),
    cache_salt: bool = typer.Option(
        _FIELDS["cache_salt"].default, "--cache-salt/--no-cache-salt",
        help="Send each tenant's vLLM cache_salt (keeps tenants' KV blocks apart). --no-cache-salt (single tenant "
        "only) lets a gateway that cannot hash salted requests, such as vllm-router's kv_aware, prefix-route them."),
    max_in_flight: int | None = typer.Option(
        None, "--max-in-flight", min=1, show_default=False,
        help="Requests one replica can run at once (vLLM's --max-num-seqs). While the proxy has that many per healthy "
        "replica in flight, arriving requests are held (at most --hold-ms) and released together in the window "
        "planner's order. Default: off, nothing is held (unless --hold-fit)."),
    hold_fit: bool = typer.Option(
        _FIELDS["hold_fit"].default, "--hold-fit/--no-hold-fit",
        help="Hold while the requests in flight fill the replicas' KV caches together (their prompts' estimated "
        "tokens against the cache sizes read from the engines), as vLLM would queue them: the hold queue without "
        "finding --max-in-flight (with it, both bounds hold)."),
    hold_ms: float = typer.Option(_FIELDS["hold_ms"].default, "--hold-ms",
                                  help=f"The longest a request is held, in milliseconds, at most {HOLD_MS_MAX:.0f} (with "
                                  "--max-in-flight or --hold-fit). Seconds pay only where arrivals outrun the replicas for a while."),
    hold_split: bool = typer.Option(
        _FIELDS["hold_split"].default, "--hold-split/--no-hold-split",
        help="Split a held window that outgrows the replicas' caches over them: one run of the planned order per "
        "replica, even in prefill work, each in shortest-mean-work order (with --max-in-flight)."),
    hold_pick: bool = typer.Option(
        _FIELDS["hold_pick"].default, "--hold-pick/--no-hold-pick",
        help="Instead of releasing every held request at once, a replica with room takes one held request at a time: "
        "the rest of the planned run it serves, else the one whose planned block order finds the longest prefix in "
        "what the proxy sent it (needs --max-in-flight, a replica's count; not with --upstream)."),
    fit: bool = typer.Option(
        _FIELDS["fit"].default, "--fit/--no-fit",
        help="Cache-fit admission: a replica takes a new conversation only while the conversations it serves fit its "
        "KV cache (size from the engine's /metrics); the others wait, first come first served."),
    fit_fill: float = typer.Option(_FIELDS["fit_fill"].default, "--fit-fill",
                                   help="The share of a replica's KV cache live conversations may take (about "
                                   "0.9 / K with K proxy workers in front of the same replicas)."),
    fit_max_wait: float = typer.Option(_FIELDS["fit_max_wait_s"].default, "--fit-max-wait",
                                       help="The longest a turn waits for room in a replica's cache, in seconds."),
    fit_idle_ms: float = typer.Option(_FIELDS["fit_idle_ms"].default, "--fit-idle-ms",
                                      help="A conversation idle this long (milliseconds) stops holding its share "
                                      "(the longest, with --fit-learn-idle)."),
    fit_learn_idle: bool = typer.Option(
        _FIELDS["fit_learn_idle"].default, "--fit-learn-idle/--fit-fixed-idle",
        help=f"Shrink the idle window to {GAP_MARGIN:g} x the longest recent gap between an answer and its "
        "conversation's next turn (at most --fit-idle-ms), or keep it at --fit-idle-ms."),
    fit_move: bool = typer.Option(
        _FIELDS["fit_move"].default, "--fit-move/--fit-no-move",
        help="A conversation whose history no longer fits its replica's cache moves to a replica with room for it "
        "(one prefill of its history there) rather than wait for the older conversations to end."),
    engine_priority: bool = typer.Option(
        _FIELDS["engine_priority"].default, "--engine-priority/--no-engine-priority",
        help="Each engine request carries vLLM's priority: the prompt tokens its replica must still compute, so the "
        "requests a replica mostly caches are served first. Start vLLM with --scheduling-policy priority."),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
) -> None:
    """Start the proxy (blocks until interrupted)."""
    try:
        import uvicorn  # noqa: F401 - checked here, run by cpmemory.server.launch
    except ImportError:
        typer.echo("uvicorn is not installed; run: pip install 'cpmemory[server]'", err=True)
        raise typer.Exit(code=2) from None
    from pydantic import ValidationError

    from cpmemory.server.app import create_app
    from cpmemory.server.launch import serve

    engine, kv_events, api_key = engine or [], kv_events or [], api_key or []
    if not engine and upstream is None:
        raise typer.BadParameter("give --engine URL (repeatable) or --upstream URL")
    if kv_events and len(kv_events) != len(engine):
        raise typer.BadParameter("give one --kv-events endpoint per --engine, in the same order")
    if router_policy not in ("prefix", "affinity", "session"):
        raise typer.BadParameter("--router must be prefix, affinity or session")
    redis_config = SERVER_REDIS.model_copy(update={"prefix": redis_prefix, "socket_timeout_s": redis_timeout,
                                                   "connect_timeout_s": redis_timeout})
    try:
        config = ServerConfig(
            engines=engine, redis_url=redis, redis=RedisStoreConfig.model_validate(redis_config.model_dump()),
            api_keys=parse_api_keys(api_key, api_keys_file), cache_salt_secret=cache_salt_secret,
            cache_salt=cache_salt, upstream_session=upstream_session,
            engine_timeout_s=engine_timeout, kv_events=kv_events, tokenizer=tokenizer,
            upstream=upstream, router=RouterConfig(policy=router_policy),  # type: ignore[arg-type]
            replica_cache_tokens=replica_cache_tokens, max_in_flight=max_in_flight, hold_fit=hold_fit, hold_ms=hold_ms,
            hold_split=hold_split, hold_pick=hold_pick,
            fit=fit, fit_fill=fit_fill, fit_max_wait_s=fit_max_wait, fit_idle_ms=fit_idle_ms, fit_learn_idle=fit_learn_idle, fit_move=fit_move,
            engine_priority=engine_priority,
        )
        app = create_app(config)
    except ValidationError as error:
        raise typer.BadParameter(str(error)) from error
    except (InvalidInputError, MissingDependencyError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from error
    serve(app, config, host=host, port=port, log_level=log_level)  # checks the store first
