"""Fixtures shared by every kind of test: the real Redis (``real_redis``, ``run_prefix``) and a local Redis Cluster.

The real Redis is 127.0.0.1:6379 (``CPM_REDIS_URL`` overrides); keys go under a prefix unique to this run and are
deleted at the end of the session. The cluster (3 masters, ``redis-server`` + ``redis-cli --cluster create``) starts
on first use and stops at the end of the session. The layout (tests/README.md): ``unit`` needs none of these.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpmemory.errors import StoreUnavailableError
from cpmemory.testing.local_redis import LocalRedisCluster, redis_binaries_available
from tests.redis_env import RUN_PREFIX, redis_url

TESTS = Path(__file__).resolve().parent
UNIT = TESTS / "unit"
KINDS = ("unit", "contract", "integration", "e2e")  # tests/README.md
# What a unit test must not need; a test that does belongs in tests/contract, tests/integration or tests/e2e.
NOT_UNIT_MARKERS = ("slow", "redis", "cluster", "vllm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/ lives in one of the kind folders, and tests/unit holds no test marked as needing a
    server, a real engine or a long run (``make check`` runs all of tests/unit)."""
    misplaced = []
    for item in items:
        path = Path(str(item.path)).resolve()
        if not path.is_relative_to(TESTS):
            continue  # the adapters' own suites (integrations/*/tests)
        if path.relative_to(TESTS).parts[0] not in KINDS:
            misplaced.append(f"{item.nodeid} (not under tests/{{{','.join(KINDS)}}})")
        elif path.is_relative_to(UNIT) and any(item.get_closest_marker(m) for m in NOT_UNIT_MARKERS):
            marks = ", ".join(m for m in NOT_UNIT_MARKERS if item.get_closest_marker(m))
            misplaced.append(f"{item.nodeid} (marked {marks}: not a unit test)")
    if misplaced:
        raise pytest.UsageError("tests outside the layout of tests/README.md:\n  " + "\n  ".join(misplaced))


@pytest.fixture(scope="session")
def real_redis() -> Iterator[str]:
    """URL of the real Redis (skips when it is not reachable); deletes this run's keys at the end."""
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(redis_url(), socket_timeout=2, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as error:
        pytest.skip(f"real Redis not reachable at {redis_url()}: {error}")
    yield redis_url()
    for key in client.scan_iter(match=f"{RUN_PREFIX}*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
def run_prefix() -> str:
    """A key prefix for one test, under this run's prefix (so the session cleanup deletes its keys)."""
    return f"{RUN_PREFIX}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A local 3-master Redis Cluster for the whole session (skips without redis-server / redis-cli)."""
    if not redis_binaries_available():
        pytest.skip("redis-server / redis-cli not on PATH")
    try:
        cluster = LocalRedisCluster(masters=3).start()
    except StoreUnavailableError as error:
        pytest.skip(str(error))
    yield cluster
    cluster.close()
