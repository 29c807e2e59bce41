"""Per-tenant vLLM ``cache_salt`` values, keyed by a secret that has no public default.

The salt of a tenant is a keyed BLAKE2b of its name: stable across restarts and workers when they share the secret,
unpredictable to anyone without it. The secret comes from the configuration, or is generated once and kept in Redis
(``SET NX`` on ``<prefix>:cache-salt-secret``: the first worker to start writes it, every other one reads it), or,
for a single-tenant proxy without Redis, is generated per process. If Redis cannot be reached when the secret is
first needed, a per-process secret serves meanwhile (tenants stay isolated; only reuse across workers is lost) and
Redis is asked again on the next request.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
from typing import Any

logger = logging.getLogger(__name__)
SECRET_KEY_SUFFIX = ":cache-salt-secret"


class CacheSalts:
    """Derives each tenant's ``cache_salt``. Call :meth:`ready` (async, cheap once resolved) before :meth:`salt`."""

    def __init__(self, secret: str | None, *, redis_client: Any = None, redis_prefix: str = "cpm") -> None:
        """A given ``secret``, or one kept in Redis through ``redis_client``, or a per-process one. No IO."""
        self._client = redis_client if secret is None else None
        self._key = redis_prefix + SECRET_KEY_SUFFIX
        self._secret: bytes | None = secret.encode("utf-8") if secret is not None else None
        if self._secret is None and self._client is None:
            self._secret = secrets.token_bytes(32)
        self._interim = secrets.token_bytes(32)

    @property
    def resolved(self) -> bool:
        """True once the final secret is known (given, read from Redis, or per process)."""
        return self._secret is not None

    async def ready(self) -> None:
        """Resolve the secret kept in Redis on first use (one ``SET NX`` + ``GET``); never raises."""
        if self._secret is not None or self._client is None:
            return
        candidate = secrets.token_hex(32)
        try:
            await self._client.set(self._key, candidate, nx=True)
            stored = await self._client.get(self._key)
        except Exception as error:  # noqa: BLE001 - any Redis failure: serve with the interim secret, retry later
            logger.warning("cache-salt secret not readable from Redis (%s); per-process secret meanwhile", error)
            return
        if stored:
            self._secret = stored if isinstance(stored, bytes) else str(stored).encode("utf-8")

    def salt(self, tenant: str) -> str:
        """The tenant's ``cache_salt`` (hex). Pure once the secret is resolved."""
        key = (self._secret or self._interim)[:64]
        return hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), key=key, digest_size=16).hexdigest()
