"""The real Redis the tests use and this run's key prefix (a plain module: test modules import it, not conftest)."""
from __future__ import annotations

import os
import uuid

RUN_PREFIX = f"cpmtest-{uuid.uuid4().hex[:10]}"


def redis_url() -> str:
    """The real Redis used by the tests."""
    return os.environ.get("CPM_REDIS_URL", "redis://127.0.0.1:6379/0")
