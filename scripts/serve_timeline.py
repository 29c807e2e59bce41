"""Where a client's TTFT goes through the in-process proxy of ``cpmemory bench serve``, step by step.

    .venv/bin/python scripts/serve_timeline.py bench serve --workload mt_rag --data-dir ../shared/data \
        --engine http://127.0.0.1:18100 --engine http://127.0.0.1:18101 --strategies cpmemory-nofit,cpmemory --json

Runs the ``cpmemory`` command line given, with timers wrapped around four steps of the proxy (``ProxyService``) and
the bench's proxy client, and prints to stderr, per strategy (in run order), the mean milliseconds of: the client's
send to the proxy's handler, the handler to the engine call (``prepare``), the engine call's opening (admission's wait,
shown apart, plus the engine's response headers), the headers to the first generated token at the proxy, and that
token's relay to the client; then the handler-to-engine-call step split into the hold queue's wait (with
``--max-in-flight``), the facade's prepare (the prompt budget's checks included) and the wait for the previous
request of a released window to be sent. A measuring aid for docs/bench-serve.md, not part of the package; it patches internals
and breaks when they change.
"""
from __future__ import annotations

import re
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import cpmemory.bench.serve_clients as serve_clients
import cpmemory.server.service as service

STEPS = ("c0", "p0", "p1", "p2", "p3", "c1")
TOKEN = re.compile(rb'"content":"[^"]')
timeline: dict[tuple[str, float], dict[str, float]] = defaultdict(dict)
current: dict[str, tuple[str, float]] = {}  # conversation -> its turn being served (a conversation's turns are serial)
by_stream: dict[int, tuple[str, float]] = {}


def patch() -> None:
    import cpmemory.server.app as app_module

    arrived, open_stream, relay = (service.ProxyService.arrived, service.ProxyService.open_turn_stream,
                                   service.ProxyService.relay_stream)
    send = serve_clients.ProxyClient.send
    admit, prepare = app_module.admit, service.ProxyService.prepare

    async def timed_admit(service_: Any, raw: Any, tenant: str, turn: Any) -> Any:
        admission = await admit(service_, raw, tenant, turn)
        key = current.get(turn.conversation_id) if turn is not None else None
        if key is not None:
            timeline[key]["a1"] = time.perf_counter()
        return admission

    async def timed_prepare(self: Any, tenant: str, turn: Any, request: Any = None) -> Any:
        key = current.get(turn.conversation_id)
        if key is not None:
            timeline[key]["q0"] = time.perf_counter()
        prepared = await prepare(self, tenant, turn, request)
        if key is not None:
            timeline[key]["q1"] = time.perf_counter()
        return prepared

    def timed_arrived(self: Any, tenant: str, turn: Any) -> None:
        key = current[turn.conversation_id] = (turn.conversation_id, time.perf_counter())
        timeline[key]["p0"] = key[1]
        arrived(self, tenant, turn)

    async def timed_open(self: Any, request: Any, tenant: str, turn: Any, prepared: Any) -> Any:
        key = current[turn.conversation_id]
        timeline[key]["p1"] = time.perf_counter()
        opened = await open_stream(self, request, tenant, turn, prepared)
        timeline[key].update(p2=time.perf_counter(), wait=opened.fit.waited_s)
        by_stream[id(opened.dispatch)] = key  # the app replaces the OpenedStream; its dispatch stays
        return opened

    async def timed_relay(self: Any, opened: Any, prepared: Any, overhead_s: float) -> Any:
        key = by_stream.pop(id(opened.dispatch), None)
        async for chunk in relay(self, opened, prepared, overhead_s):
            if key is not None and "p3" not in timeline[key] and TOKEN.search(chunk):
                timeline[key]["p3"] = time.perf_counter()
            yield chunk

    async def timed_send(self: Any, conversation: str, *args: Any) -> Any:
        started = time.perf_counter()
        sent = await send(self, conversation, *args)
        key = current.get(conversation)
        if key is not None and sent.ttft_s is not None:
            timeline[key].update(c0=started, c1=started + sent.ttft_s)
        return sent

    app_module.admit = timed_admit  # type: ignore[assignment]
    service.ProxyService.prepare = timed_prepare  # type: ignore[method-assign]
    service.ProxyService.arrived = timed_arrived  # type: ignore[method-assign]
    service.ProxyService.open_turn_stream = timed_open  # type: ignore[method-assign]
    service.ProxyService.relay_stream = timed_relay  # type: ignore[method-assign]
    serve_clients.ProxyClient.send = timed_send  # type: ignore[method-assign]


def report(strategies: int) -> None:
    rows = sorted((row for row in timeline.values() if all(step in row for step in STEPS)), key=lambda row: row["p0"])
    print(f"timed {len(rows)} of {len(timeline)} turns", file=sys.stderr)
    size = max(1, len(rows) // max(1, strategies))
    for index in range(0, len(rows), size):
        part = rows[index:index + size]

        def ms(a: str, b: str, part: list[dict[str, float]] = part) -> float:
            return round(1000 * statistics.mean(row[b] - row[a] for row in part), 1)

        wait = round(1000 * statistics.mean(row["wait"] for row in part), 1)
        print(f"strategy {index // size + 1}: client->handler {ms('c0', 'p0')} ms, prepare {ms('p0', 'p1')}, "
              f"admission wait {wait}, engine headers {round(ms('p1', 'p2') - wait, 1)}, first token "
              f"{ms('p2', 'p3')}, relay {ms('p3', 'c1')}; client TTFT {ms('c0', 'c1')}", file=sys.stderr)
        if all("a1" in row and "q0" in row and "q1" in row for row in part):
            print(f"  of prepare: hold {ms('p0', 'a1')} ms, facade prepare {ms('q0', 'q1')}, the window's send turn "
                  f"{ms('q1', 'p1')}", file=sys.stderr)


def main() -> None:
    from cpmemory.cli import app

    args = sys.argv[1:]
    strategies = next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--strategies"), "cpmemory")
    patch()
    try:
        app(args, standalone_mode=False)
    finally:
        report(len([name for name in strategies.split(",") if name != "original"]))


if __name__ == "__main__":
    main()
