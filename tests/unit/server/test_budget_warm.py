"""The prompt budget asks the engine's limits when the proxy starts, so a burst of first requests does not wait."""
from __future__ import annotations

from cpmemory.engines.client import AsyncEngineClient
from cpmemory.server.budget import EngineBudget
from cpmemory.testing.mock_engine import MockEngine


async def test_warm_knows_the_listed_models_limits_before_any_request() -> None:
    engine = MockEngine(max_model_len=4096)
    async with AsyncEngineClient("http://engine", transport=engine.transport()) as client:
        asked: list[str] = []
        listing = client.models

        async def models() -> dict[str, object]:
            asked.append("models")
            return await listing()

        client.models = models  # type: ignore[method-assign]
        budget = EngineBudget(client)
        await budget.warm()
        after_warm = len(asked)
        limits = await budget.limits("tiny")
        assert limits.max_model_len == 4096 and limits.tokenize
        assert after_warm >= 1 and len(asked) == after_warm  # known from the warm-up: no call of its own


async def test_warm_never_raises_when_the_engine_is_not_up() -> None:
    class Down:
        async def models(self) -> dict[str, object]:
            raise ConnectionError("not up yet")

    budget = EngineBudget(Down())
    await budget.warm()
    assert budget.client is not None
