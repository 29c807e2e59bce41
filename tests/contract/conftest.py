"""Store contract fixtures: every SessionStore backend behind one small factory (``backend``).

Backends: the in-memory store (manual clock), fakeredis (Lua through lupa), the real Redis (marker ``redis``) and a
local Redis Cluster (marker ``cluster``), the last two from tests/conftest.py. ``make check`` runs the first two.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from cpmemory.stores.base import DEFAULT_MAX_TRANSCRIPT_TURNS
from cpmemory.stores.redis_store import AsyncRedisSessionStore, RedisSessionStore, RedisStoreConfig
from tests.redis_env import RUN_PREFIX


@dataclass
class Backend:
    """Makes fresh stores of one kind. ``sleep`` lets time pass (a manual clock for the in-memory store)."""

    name: str
    make_sync: Callable[..., Any]  # (ttl_s, max_transcript_turns) -> store
    make_async: Callable[..., Any]
    sleep: Callable[[float], None]
    timing_slack_s: float = 0.0


class ManualClock:
    """A monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _memory_backend() -> Backend:
    from cpmemory.stores.memory import AsyncInMemorySessionStore, InMemorySessionStore

    clock = ManualClock()
    return Backend(
        "memory",
        lambda ttl, turns=DEFAULT_MAX_TRANSCRIPT_TURNS: InMemorySessionStore(
            ttl_s=ttl, clock=clock, max_transcript_turns=turns
        ),
        lambda ttl, turns=DEFAULT_MAX_TRANSCRIPT_TURNS: AsyncInMemorySessionStore(
            ttl_s=ttl, clock=clock, max_transcript_turns=turns
        ),
        clock.advance,
    )


def _fakeredis_backend() -> Backend:
    fakeredis = pytest.importorskip("fakeredis")
    pytest.importorskip("lupa", reason="fakeredis needs lupa for Lua scripts")
    server = fakeredis.FakeServer()

    def config(ttl: float, turns: int) -> RedisStoreConfig:
        return RedisStoreConfig(prefix=RUN_PREFIX, ttl_s=ttl, max_transcript_turns=turns)

    return Backend(
        "fakeredis",
        lambda ttl, turns=DEFAULT_MAX_TRANSCRIPT_TURNS: RedisSessionStore(
            fakeredis.FakeRedis(server=server), config(ttl, turns)
        ),
        lambda ttl, turns=DEFAULT_MAX_TRANSCRIPT_TURNS: AsyncRedisSessionStore(
            fakeredis.FakeAsyncRedis(server=server), config(ttl, turns)
        ),
        time.sleep,
        timing_slack_s=0.1,
    )


def _url_backend(name: str, url: str, cluster: bool) -> Backend:
    def config(ttl: float, turns: int) -> RedisStoreConfig:
        return RedisStoreConfig(
            prefix=RUN_PREFIX, ttl_s=ttl, socket_timeout_s=5.0, connect_timeout_s=2.0, max_transcript_turns=turns
        )

    return Backend(
        name,
        lambda ttl, turns=DEFAULT_MAX_TRANSCRIPT_TURNS: RedisSessionStore.from_url(
            url, config(ttl, turns), cluster=cluster
        ),
        lambda ttl, turns=DEFAULT_MAX_TRANSCRIPT_TURNS: AsyncRedisSessionStore.from_url(
            url, config(ttl, turns), cluster=cluster
        ),
        time.sleep,
        timing_slack_s=0.1,
    )


@pytest.fixture(
    params=[
        "memory",
        "fakeredis",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ]
)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend in turn (the real-Redis ones are marked, and skipped when unavailable)."""
    name = request.param
    if name == "memory":
        return _memory_backend()
    if name == "fakeredis":
        return _fakeredis_backend()
    if name == "redis":
        return _url_backend(name, request.getfixturevalue("real_redis"), cluster=False)
    return _url_backend(name, request.getfixturevalue("redis_cluster").url, cluster=True)
