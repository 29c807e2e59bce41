"""A fake engine fleet behind the ChatTransport seam: prefix-cache accounting per replica, switchable outages."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from cpmemory.errors import EngineStatusError, EngineUnreachableError


class FakeFleet:
    """Replicas keyed by URL. Each remembers the prompts it served and reports cached characters / 4 as tokens."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.reject: set[str] = set()
        self.prompts: dict[str, list[str]] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _cached(self, url: str, prompt: str) -> int:
        best = 0
        for earlier in self.prompts.get(url, []):
            common = 0
            for a, b in zip(earlier, prompt):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return best // 4

    async def complete(self, base_url: str, payload: Mapping[str, Any], headers: Mapping[str, str],
                       timeout_s: float) -> dict[str, Any]:
        if base_url in self.down:
            raise EngineUnreachableError(f"{base_url} is down")
        if base_url in self.reject:
            raise EngineStatusError(400, b'{"error": "bad"}')
        prompt = json.dumps(payload["messages"])
        cached = self._cached(base_url, prompt)
        self.prompts.setdefault(base_url, []).append(prompt)
        self.calls.append((base_url, dict(payload)))
        return {"choices": [{"message": {"role": "assistant", "content": f"answer {len(self.calls)}"}}],
                "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": 2,
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    async def open_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def is_healthy(self, base_url: str) -> bool:
        return base_url not in self.down

    async def aclose(self) -> None:
        return None


@pytest.fixture
def fleet() -> FakeFleet:
    return FakeFleet()
