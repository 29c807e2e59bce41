"""A minimal gateway as a real process, standing in for vllm-router in tests that must know where each request went:
``python gateway_server.py PORT URL [URL ...]`` forwards every request to one of the replica URLs. A chat request
naming a session (``session_params.session_id``) goes to the replica its session first went to (sticky); a new
session, or a request naming none, goes to the next replica in turn. Responses are relayed whole (a stream's events
arrive together, which a client reads the same).
"""
from __future__ import annotations

import itertools
import json
import sys

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def build(replicas: list[str]) -> Starlette:
    sessions: dict[str, str] = {}
    turn = itertools.cycle(replicas)
    client = httpx.AsyncClient(timeout=60)

    def pick(body: bytes) -> str:
        try:
            session = (json.loads(body).get("session_params") or {}).get("session_id")
        except (ValueError, AttributeError):
            session = None
        if session is None:
            return next(turn)
        if session not in sessions:
            sessions[session] = next(turn)
        return sessions[session]

    async def forward(request: Request) -> Response:
        body = await request.body()
        target = pick(body) if request.url.path.endswith("/chat/completions") else replicas[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        answer = await client.request(request.method, target + request.url.path, content=body, headers=headers,
                                      params=request.query_params)
        kept = {k: v for k, v in answer.headers.items()
                if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")}
        return Response(answer.content, status_code=answer.status_code, headers=kept)

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


if __name__ == "__main__":
    uvicorn.run(build([url.rstrip("/") for url in sys.argv[2:]]), host="127.0.0.1", port=int(sys.argv[1]),
                log_level="error")
