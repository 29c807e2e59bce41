"""A mock engine replica as a real process: ``python engine_server.py PORT`` serves cpmemory.engines.mock on loopback.

Extra endpoint for tests: ``GET /_mock/requests`` -> [{"request_id", "messages", "cache_salt"}] of every chat request.
"""
from __future__ import annotations

import sys

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cpmemory.engines.mock import MockEngine


def build(engine: MockEngine) -> Starlette:
    async def recorded(_: Request) -> Response:
        return JSONResponse([{"request_id": r["request_id"], "messages": r["body"].get("messages"),
                              "cache_salt": r["body"].get("cache_salt")} for r in engine.requests])

    async def forward(request: Request) -> Response:
        inner = httpx.Request(request.method, str(request.url), headers=request.headers.raw,
                              content=await request.body())
        answer = engine.handle(inner)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-encoding")}
        return Response(answer.content, status_code=answer.status_code, headers=headers)

    return Starlette(routes=[Route("/_mock/requests", recorded),
                             Route("/{path:path}", forward, methods=["GET", "POST"])])


if __name__ == "__main__":
    uvicorn.run(build(MockEngine(block_size=16, capacity_blocks=1 << 14)), host="127.0.0.1",
                port=int(sys.argv[1]), log_level="error")
