"""``cpmemory mock-engine``: the mock engine (cpmemory.testing.mock_engine) as an HTTP server, to try the proxy
without a GPU or a model.

It answers what cpmemory and OpenAI clients ask of a vLLM server: ``POST /v1/chat/completions`` (streaming or
not, with ``usage.prompt_tokens_details.cached_tokens`` from its LRU prefix cache), ``GET /v1/models``,
``POST /tokenize``, ``GET /health``, ``GET /metrics`` (the cache size, as vLLM reports it) and
``POST /reset_prefix_cache``. Its answers are not a model's: each says how long the prompt was. With ``--kv-events tcp://HOST:PORT`` it publishes its cache changes as vLLM's KV events (ZMQ PUB),
for ``cpmemory serve --kv-events``. Needs the ``server`` extra (and ``engines`` for KV events).

Example::

    cpmemory mock-engine --port 8000
    cpmemory serve --engine http://127.0.0.1:8000 --port 8080
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import typer

from cpmemory.testing.mock_engine import MockEngine, render_chatml

DEFAULT_MODEL = "mock-model"
DEFAULT_CONTEXT = 32_768
RECORDS_KEPT = 1024
"""Requests and event batches the served engine keeps for inspection (a long run does not grow its memory)."""


def describe_prompt(engine: MockEngine) -> Any:
    """A reply function for ``engine``: says how many messages and tokens the prompt had (the mock's tokens)."""

    def reply(body: Mapping[str, Any]) -> str:
        messages = body.get("messages") or []
        tokens = len(engine.tokenize(render_chatml(messages)))
        plural = "" if len(messages) == 1 else "s"
        return (f"This is the mock engine's answer (no model runs here): the prompt had {len(messages)} "
                f"message{plural} and {tokens} tokens.")

    return reply


def build_app(engine: MockEngine, routes: Sequence[Any] = ()) -> Any:
    """A Starlette app that serves ``engine`` (a worker thread answers when the mock sleeps per prefill token);
    ``routes`` (Starlette routes, e.g. test-only inspection endpoints) are matched first."""
    import httpx
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def forward(request: Request) -> Response:
        inner = httpx.Request(request.method, str(request.url), headers=request.headers.raw,
                              content=await request.body())
        # in arrival order on the loop, as one engine serves them; in a worker thread only when it sleeps per token
        if engine.prefill_s_per_token:
            answer = await run_in_threadpool(engine.handle, inner)
        else:
            answer = engine.handle(inner)
        headers = {key: value for key, value in answer.headers.items()
                   if key.lower() not in ("content-length", "content-encoding")}
        return Response(answer.content, status_code=answer.status_code, headers=headers)

    return Starlette(routes=[*routes, Route("/{path:path}", forward, methods=["GET", "POST"])])


def kv_event_listener(endpoint: str) -> Any:
    """A ZMQ PUB socket bound to ``endpoint``; returns its ``send_multipart`` (the engine's frame listener)."""
    try:
        import zmq
    except ImportError:
        typer.echo("--kv-events needs pyzmq; run: pip install 'cpmemory[engines]'", err=True)
        raise typer.Exit(code=2) from None
    socket: Any = zmq.Context.instance().socket(zmq.PUB)
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as error:
        typer.echo(f"error: cannot publish KV events on {endpoint}: {error}", err=True)
        raise typer.Exit(code=2) from error
    return socket.send_multipart


def command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="The model id /v1/models reports."),
    max_model_len: int = typer.Option(DEFAULT_CONTEXT, "--max-model-len", min=16,
                                      help="The context length in tokens /v1/models reports (one token a byte)."),
    block_size: int = typer.Option(16, "--block-size", min=1, help="Tokens per prefix-cache block."),
    capacity_blocks: int = typer.Option(4096, "--capacity-blocks", min=1,
                                        help="Blocks the prefix cache holds (least recently used evicted first)."),
    kv_events: str | None = typer.Option(None, "--kv-events", show_default=False,
                                         help="Publish KV events on this ZMQ endpoint (tcp://HOST:PORT)."),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve the mock engine (blocks until interrupted)."""
    try:
        import httpx  # noqa: F401 - the app forwards through httpx requests
        import uvicorn
    except ImportError:
        typer.echo("the mock engine needs the server extra; run: pip install 'cpmemory[server]'", err=True)
        raise typer.Exit(code=2) from None
    listener = kv_event_listener(kv_events) if kv_events else None
    engine = MockEngine(block_size=block_size, capacity_blocks=capacity_blocks, model=model,
                        max_model_len=max_model_len, listener=listener, records=RECORDS_KEPT)
    engine.reply = describe_prompt(engine)
    events = f", KV events on {kv_events}" if kv_events else ""
    typer.echo(f"cpmemory mock engine listening on http://{host}:{port} | model {model}, context {max_model_len} "
               f"tokens, prefix cache {capacity_blocks} blocks of {block_size} tokens{events}", err=True)
    uvicorn.run(build_app(engine), host=host, port=port, log_level=log_level)
