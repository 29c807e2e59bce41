"""``cpmemory serve``: start the OpenAI-compatible proxy in front of one or more engine replicas (uvicorn).

Example::

    cpmemory serve --engine http://127.0.0.1:8000 --engine http://127.0.0.1:8001 --redis redis://127.0.0.1:6379/0

Behind a gateway that picks the replica (vllm-router, llm-d, an SGLang router)::

    cpmemory serve --upstream http://127.0.0.1:18120 --upstream-kind vllm-router \
        --engine http://127.0.0.1:18110 --kv-events tcp://127.0.0.1:15610 \
        --engine http://127.0.0.1:18111 --kv-events tcp://127.0.0.1:15611

The flags cover what most deployments set; every other setting goes in ``--config FILE`` (TOML or YAML, the same
tree as :class:`~cpmemory.server.config.ServerConfig`; ``docs/reference/serve.md``), and secrets in the environment
(``CPMEMORY_CACHE_SALT_SECRET``, ``CPMEMORY_API_KEYS``). A flag given overrides the file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from cpmemory.errors import InvalidInputError, MissingDependencyError

TARGETS = "Engines and gateway"
ADMISSION = "Admission and routing"
STATE = "State and tenants"
LISTEN = "Listening"


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


def overrides(*, engine: list[str] | None = None, kv_events: list[str] | None = None, upstream: str | None = None,
              upstream_kind: str | None = None, redis: str | None = None, api_keys: dict[str, str] | None = None,
              tokenizer: str | None = None, router: str | None = None, hold: str | None = None,
              fit: bool | None = None) -> dict[str, Any]:
    """The settings the given flags set, as a nested mapping over the config file's (None: not given)."""
    given: dict[str, Any] = {}
    for key, value in (("engines", engine), ("kv_events", kv_events), ("upstream", upstream),
                       ("upstream_kind", upstream_kind), ("redis_url", redis), ("api_keys", api_keys),
                       ("tokenizer", tokenizer)):
        if value:
            given[key] = value
    if router is not None:
        given["router"] = {"policy": router}
    if hold is not None:
        given["hold"] = {"policy": hold}
    if fit is not None:
        given["fit"] = {"enabled": fit}
    return given


def command(
    config_file: Annotated[Path | None, typer.Option(
        "--config", help="A TOML or YAML file of settings (docs/reference/serve.md); flags override it.",
        rich_help_panel=TARGETS)] = None,
    engine: Annotated[list[str] | None, typer.Option(
        "--engine", help="Engine base URL (repeat for several replicas).", rich_help_panel=TARGETS)] = None,
    kv_events: Annotated[list[str] | None, typer.Option(
        "--kv-events", help="vLLM KV-event endpoint (tcp://HOST:PORT) of each engine, in --engine order.",
        rich_help_panel=TARGETS)] = None,
    upstream: Annotated[str | None, typer.Option(
        "--upstream", help="A gateway (vllm-router, llm-d, SGLang router) that picks the replica.",
        rich_help_panel=TARGETS)] = None,
    upstream_kind: Annotated[str | None, typer.Option(
        "--upstream-kind", help="The gateway's kind: vllm-router (names conversations, no cache salt on one "
        "tenant), llm-d, sglang or generic.", rich_help_panel=TARGETS, show_default=False)] = None,
    hold: Annotated[str | None, typer.Option(
        "--hold", help="off (chats, agents), window (bursts: held requests released together in the planner's "
        "order) or pick (overload: a free replica takes the held request it caches most of).",
        rich_help_panel=ADMISSION, show_default=False)] = None,
    fit: Annotated[bool | None, typer.Option(
        "--fit/--no-fit", help="Cache-fit admission: a replica takes a new conversation only while the live ones "
        "fit its KV cache (on by default).", rich_help_panel=ADMISSION, show_default=False)] = None,
    router: Annotated[str | None, typer.Option(
        "--router", help="prefix (cached prefix + load, the default), affinity (hash of the conversation) or "
        "session (least loaded, then sticky).", rich_help_panel=ADMISSION, show_default=False)] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="The served model's tokenizer (directory, Hugging Face id or 'auto'), to tokenize "
        "prompts in the proxy instead of by each engine's /tokenize.", rich_help_panel=ADMISSION,
        show_default=False)] = None,
    redis: Annotated[str | None, typer.Option(
        "--redis", help="Session store: redis://HOST:PORT/DB, or redis+cluster://HOST:PORT for a Redis Cluster "
        "(default: in memory). Checked before the proxy listens.", rich_help_panel=STATE)] = None,
    api_keys_file: Annotated[Path | None, typer.Option(
        "--api-keys-file", help="JSON object {KEY: TENANT} (or CPMEMORY_API_KEYS).", rich_help_panel=STATE)] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.", rich_help_panel=LISTEN)] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.", rich_help_panel=LISTEN)] = 8080,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.",
                                           rich_help_panel=LISTEN)] = "warning",
) -> None:
    """Start the proxy (blocks until interrupted)."""
    try:
        import uvicorn  # noqa: F401 - checked here, run by cpmemory.server.launch
    except ImportError:
        typer.echo("uvicorn is not installed; run: pip install 'cpmemory[server]'", err=True)
        raise typer.Exit(code=2) from None
    from pydantic import ValidationError

    from cpmemory.server.app import create_app
    from cpmemory.server.config_file import build_config
    from cpmemory.server.launch import serve

    given = overrides(engine=engine, kv_events=kv_events, upstream=upstream, upstream_kind=upstream_kind,
                      redis=redis, api_keys=parse_api_keys([], api_keys_file) if api_keys_file else None,
                      tokenizer=tokenizer, router=router, hold=hold, fit=fit)
    try:
        config = build_config(config_file, given)
        app = create_app(config)
    except ValidationError as error:
        raise typer.BadParameter(str(error)) from error
    except (InvalidInputError, MissingDependencyError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from error
    serve(app, config, host=host, port=port, log_level=log_level)  # checks the store first
