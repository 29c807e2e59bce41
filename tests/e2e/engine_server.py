"""A mock engine replica as a real process: ``python engine_server.py PORT [KV_PORT [CAPACITY_BLOCKS]]`` serves
cpmemory.testing.mock_engine on loopback; with KV_PORT it publishes its KV events on tcp://127.0.0.1:KV_PORT (ZMQ PUB, the
frames vLLM sends).

Extra endpoint for tests: ``GET /_mock/requests`` -> [{"request_id", "messages", "cache_salt"}] of every chat request.
"""
from __future__ import annotations

import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cpmemory.testing.mock_engine import MockEngine
from cpmemory.testing.mock_server import build_app


def build(engine: MockEngine) -> Starlette:
    async def recorded(_: Request) -> Response:
        return JSONResponse([{"request_id": r["request_id"], "messages": r["body"].get("messages"),
                              "cache_salt": r["body"].get("cache_salt")} for r in engine.requests])

    return build_app(engine, [Route("/_mock/requests", recorded)])


def main(argv: list[str]) -> None:
    listener = None
    if len(argv) > 2:
        import zmq

        socket = zmq.Context.instance().socket(zmq.PUB)
        socket.bind(f"tcp://127.0.0.1:{int(argv[2])}")
        listener = socket.send_multipart
    capacity = int(argv[3]) if len(argv) > 3 else 1 << 14
    engine = MockEngine(block_size=16, capacity_blocks=capacity, listener=listener)
    uvicorn.run(build(engine), host="127.0.0.1", port=int(argv[1]), log_level="error")


if __name__ == "__main__":
    main(sys.argv)
