"""bench serve against real engine processes (mock replicas on loopback) when replicas die or hang mid-run.

A replica killed mid-run: the remaining requests fail over to the other replica, the run finishes and reports what
failed; with no replica left every request errors clearly; a replica that accepts connections and never answers
holds no client past its deadline.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from cpmemory.bench.loaders import load_synthetic
from cpmemory.bench.serve import run_serve
from cpmemory.bench.serve_run import ServeSettings

TRACE = load_synthetic(requests=24, blocks_per_request=3, corpus_size=12, block_words=20, turns_per_session=3)


def killer(process, after: int, strategy: str):
    seen = {"count": 0}

    def progress(name, outcome) -> None:
        if name == strategy:
            seen["count"] += 1
            if seen["count"] == after:
                process.stop()

    return progress


@pytest.mark.parametrize("strategy", ["original", "cpmemory"])
def test_a_replica_killed_mid_run_fails_over_and_the_run_finishes(processes, strategy):
    engines = [processes.engine().start(), processes.engine().start()]
    settings = ServeSettings(engines=tuple(e.url for e in engines), requests=24, concurrency=4, timeout_s=20,
                             engine_timeout_s=5, strategies=(strategy,))
    report = asyncio.run(run_serve(TRACE, settings, killer(engines[0], 6, strategy)))
    figures, details = report["strategies"][strategy], report["details"][strategy]
    assert details["requests"] == 24 and details["answered"] + figures["errors"] == 24
    assert figures["lost_blocks"] == 0 and details["unchecked"] == 0
    assert figures["prompt_tokens"] > 0 and figures["cached_tokens"] > 0  # the engine's usage reached the client
    # turns in flight on the killed replica (at most concurrency - 1 besides the sixth) may break or still finish
    # there; every later one went to the survivor
    in_flight = settings.concurrency - 1
    assert figures["errors"] <= settings.concurrency, details["error_samples"]
    assert details["requests_per_replica"].get("1", 0) >= 24 - 6 - in_flight - figures["errors"]


def test_no_replica_left_errors_clearly_and_quickly(processes):
    engines = [processes.engine().start(), processes.engine().start()]
    for engine in engines:
        engine.stop()
    settings = ServeSettings(engines=tuple(e.url for e in engines), requests=9, concurrency=3, timeout_s=20,
                             engine_timeout_s=5)
    report = asyncio.run(run_serve(TRACE, settings))
    for name in ("original", "cpmemory"):
        assert report["strategies"][name]["errors"] == 9
        # clearly and at once: every request fails as "no replica", none by running into its deadline
        assert not any("Timeout" in kind for kind in report["details"][name]["errors_by_kind"])
        assert report["details"][name]["reset"] == {e.url: False for e in engines}
    assert "NoHealthyReplicaError" in report["details"]["original"]["errors_by_kind"]
    assert any("503" in sample and "no_healthy_replica" in sample
               for sample in report["details"]["cpmemory"]["error_samples"])


@contextlib.asynccontextmanager
async def black_hole():
    """A TCP server that accepts connections and never answers."""
    held = []

    async def swallow(reader, writer):
        held.append(writer)
        with contextlib.suppress(Exception):
            await reader.read(-1)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()


@pytest.mark.parametrize("strategy", ["original", "cpmemory"])
def test_a_replica_that_never_answers_holds_no_client_past_its_deadline(processes, strategy):
    live = processes.engine().start()

    async def main():
        async with black_hole() as dead:
            settings = ServeSettings(engines=(live.url, dead), requests=12, concurrency=4, timeout_s=3.0,
                                     engine_timeout_s=1.0, strategies=(strategy,))
            return await run_serve(TRACE, settings)

    report = asyncio.run(main())
    details = report["details"][strategy]
    # every request is reported, answered or failed: none is left waiting on the replica that never answers
    assert details["requests"] == 12 and details["answered"] + report["strategies"][strategy]["errors"] == 12
    # the hung replica is failed over after the engine timeout; no answer came after its request's deadline
    assert report["strategies"][strategy]["latency_mean_ms"] is None or \
        report["strategies"][strategy]["latency_mean_ms"] < 3000
    assert details["answered"] >= 1
