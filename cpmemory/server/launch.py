"""What ``cpmemory serve`` does once its app is built: check the session store, say what it serves, run uvicorn.

A store that cannot be used as configured stops the start with one line on stderr and exit status 2
(:func:`cpmemory.server.store_setup.check_store`), rather than a proxy that would serve every turn pass-through.
The start line names the listening address, the engines (or the gateway), the store and the policies in force.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from cpmemory.errors import CpMemoryError
from cpmemory.server.config import ServerConfig
from cpmemory.server.store_setup import build_store, check_store, describe_store

STORE_EXIT_CODE = 2


async def _check_configured_store(config: ServerConfig) -> None:
    store = build_store(config)
    try:
        await check_store(store)
    finally:
        closer = getattr(store, "close", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


def start_line(config: ServerConfig, host: str, port: int) -> str:
    """One line that says what the proxy serves. Pure."""
    targets = f"gateway {config.upstream} (replicas: {', '.join(config.engines) or 'not named'})" \
        if config.upstream else f"engines {', '.join(config.engines)}"
    policies = [f"router {config.router.policy}", f"cache-fit {'on' if config.fit.enabled else 'off'}",
                f"hold {config.hold.policy}",
                f"prompt budget {'on' if config.prompt_budget else 'off'}",
                f"tenants {len(config.api_keys) or 'single'}",
                f"KV events {'on' if config.kv_events else 'off'}"]
    return (f"cpmemory proxy listening on http://{host}:{port} | {targets} | store: {describe_store(config)} | "
            + ", ".join(policies))


def serve(app: Any, config: ServerConfig, *, host: str, port: int, log_level: str) -> None:
    """Check the store, print the start line, serve ``app`` with uvicorn (blocks until interrupted).

    Raises:
        typer.Exit: the store cannot be used as configured (after one line on stderr that says why).
    """
    import typer
    import uvicorn

    try:
        asyncio.run(_check_configured_store(config))
    except CpMemoryError as error:
        typer.echo(f"error: the session store cannot be used: {error}", err=True)
        raise typer.Exit(code=STORE_EXIT_CODE) from error
    typer.echo(start_line(config, host, port), err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
