"""schemathesis over the proxy's OpenAPI schema (positive and negative examples), mock engines behind it:
no 5xx, every error the proxy produces has the typed body, and the mock engines never see a rejected request."""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from cpmemory.server.app import ServerConfig, create_app
from cpmemory.testing.fleet import MockFleet

FLEET = MockFleet(2, block_size=16, capacity_blocks=512)
ENGINES = FLEET.engines
APP = create_app(ServerConfig(engines=FLEET.urls), transport=FLEET.chat_transport())
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_typed_4xx(case) -> None:
    engine_calls = sum(len(engine.requests) for engine in ENGINES.values())
    response = case.call()
    assert response.status_code < 500 or (case.path == "/healthz" and response.status_code == 503), response.text
    if response.status_code >= 400 and case.path != "/healthz":
        error = response.json()["error"]
        assert error["type"] and error["code"] and isinstance(error["message"], str)
        assert sum(len(engine.requests) for engine in ENGINES.values()) == engine_calls
