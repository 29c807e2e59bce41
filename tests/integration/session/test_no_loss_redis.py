"""The adversarial no-loss property suite (tests/unit/session/test_no_loss_properties.py) over the facade on the real
Redis: nothing a caller passes is lost."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from cpmemory.facade import CpMemory
from tests.unit.session.test_no_loss_properties import operations, run_operations


@pytest.fixture(scope="module")
def redis_store() -> Any:
    redis = pytest.importorskip("redis")
    from cpmemory.stores.redis_store import RedisSessionStore, RedisStoreConfig

    url = os.environ.get("CPM_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"cpmtest-noloss-{uuid.uuid4().hex[:10]}"
    try:
        redis.Redis.from_url(url).ping()
    except Exception as error:  # noqa: BLE001 - no Redis here: skip
        pytest.skip(f"no Redis at {url}: {error}")
    store = RedisSessionStore.from_url(url, RedisStoreConfig(prefix=prefix))
    yield store
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()
    store.close()


@pytest.mark.redis
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(operations)
def test_facade_on_real_redis_loses_nothing(redis_store: Any, ops: list[tuple[Any, ...]]) -> None:
    run_operations(CpMemory(redis_store), ops, tag="-" + uuid.uuid4().hex[:8])  # fresh conversations
