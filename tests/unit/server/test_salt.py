"""The cache-salt secret: never a public default; required with tenants unless Redis keeps a generated one, which
every worker on the prefix then shares; a Redis outage never stops the proxy."""
from __future__ import annotations

import uuid

import pytest
from pydantic import ValidationError

from cpmemory.server.config import ServerConfig
from cpmemory.server.salt import SECRET_KEY_SUFFIX, CacheSalts

ENGINES = ["http://engine-0"]


def test_no_public_default_secret() -> None:
    assert ServerConfig(engines=ENGINES).cache_salt_secret is None
    # without a secret, each process draws its own: no two proxies share a guessable salt
    assert CacheSalts(None).salt("default") != CacheSalts(None).salt("default")
    assert CacheSalts("s" * 16).salt("alice") == CacheSalts("s" * 16).salt("alice") != CacheSalts("s" * 16).salt("bob")


def test_tenants_need_a_secret_or_redis_and_secrets_are_not_trivial() -> None:
    keys = {"k": "alice"}
    with pytest.raises(ValidationError, match="cache_salt_secret"):
        ServerConfig(engines=ENGINES, api_keys=keys)
    with pytest.raises(ValidationError, match="16 characters"):
        ServerConfig(engines=ENGINES, api_keys=keys, cache_salt_secret="cpmemory")
    assert ServerConfig(engines=ENGINES, api_keys=keys, redis_url="redis://127.0.0.1:6379/0").cache_salt_secret is None
    assert ServerConfig(engines=ENGINES, cache_salt_secret="").cache_salt_secret is None  # an unset env var
    assert "x" * 20 not in repr(ServerConfig(engines=ENGINES, cache_salt_secret="x" * 20))  # kept secret


async def test_a_generated_secret_is_kept_in_redis_and_shared_by_workers() -> None:
    fakeredis = pytest.importorskip("fakeredis")
    server = fakeredis.FakeServer()
    prefix = f"salt-{uuid.uuid4().hex[:8]}"
    first = CacheSalts(None, redis_client=fakeredis.FakeAsyncRedis(server=server), redis_prefix=prefix)
    second = CacheSalts(None, redis_client=fakeredis.FakeAsyncRedis(server=server), redis_prefix=prefix)
    await first.ready()
    await second.ready()
    assert first.resolved and second.resolved
    assert first.salt("alice") == second.salt("alice") != first.salt("bob")
    stored = await fakeredis.FakeAsyncRedis(server=server).get(prefix + SECRET_KEY_SUFFIX)
    assert stored and len(stored) >= 32
    other = CacheSalts(None, redis_client=fakeredis.FakeAsyncRedis(server=server), redis_prefix=prefix + "-b")
    await other.ready()
    assert other.salt("alice") != first.salt("alice")  # another deployment, another secret


async def test_redis_down_at_first_use_serves_with_an_interim_secret_then_recovers() -> None:
    class Flaky:
        def __init__(self) -> None:
            self.up, self.value = False, None

        async def set(self, key, value, nx):
            if not self.up:
                raise ConnectionError("down")
            self.value = self.value or value

        async def get(self, key):
            return self.value

    client = Flaky()
    salts = CacheSalts(None, redis_client=client)
    await salts.ready()
    interim = salts.salt("alice")
    assert not salts.resolved and interim != salts.salt("bob")
    client.up = True
    await salts.ready()
    assert salts.resolved and salts.salt("alice") != interim
