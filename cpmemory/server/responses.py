"""The proxy's HTTP edge: typed error bodies, engine errors mapped to statuses, API keys to tenants, a body limit.

Every error the proxy produces itself has the body ``{"error": {"type", "code", "message", "param"?, "details"?}}``:
400 bad input, 401 unknown API key, 413 request body over ``ServerConfig.max_body_bytes``, 422 malformed JSON /
schema, 502 engine failure, 503 no healthy replica. An engine's own 4xx is relayed as the engine sent it.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from cpmemory.errors import EngineError, EngineStatusError, NoHealthyReplicaError
from cpmemory.server.schemas import ErrorBody

DEFAULT_TENANT = "default"
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 413, 422, 502, 503)
}


def error_response(status: int, error_type: str, code: str, message: str, details: Any = None,
                   param: str | None = None) -> Any:
    """A JSONResponse with the proxy's typed error body (``param``: the request field at fault, as OpenAI names it)."""
    from fastapi.responses import JSONResponse

    body = ErrorBody.model_validate({"error": {"type": error_type, "code": code, "message": message,
                                               "param": param, "details": details}})
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status)


def safe_details(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Printable fields of pydantic errors (they may hold the offending input or exception objects)."""
    return [{"loc": [str(part) for part in error.get("loc", ())], "msg": str(error.get("msg", "")),
             "type": str(error.get("type", ""))} for error in errors[:20]]


def unauthorized() -> Any:
    """401: the API key is missing or unknown."""
    return error_response(401, "authentication_error", "invalid_api_key", "unknown or missing API key")


def engine_error(error: EngineError) -> Any:
    """The response for an engine failure: 503 no healthy replica, the engine's own 4xx relayed, else 502."""
    if isinstance(error, NoHealthyReplicaError):
        return error_response(503, "engine_error", "no_healthy_replica", str(error))
    if isinstance(error, EngineStatusError) and 400 <= error.status_code < 500:
        return relay_engine_client_error(error)
    return error_response(502, "engine_error", "engine_failed", str(error))


def relay_engine_client_error(error: EngineStatusError) -> Any:
    """An engine's 4xx as it sent it (its JSON body when it has one, else a typed body with its text)."""
    from fastapi.responses import JSONResponse

    try:
        body = json.loads(error.body)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return JSONResponse(body, status_code=error.status_code)
    text = error.body if isinstance(error.body, str) else error.body.decode("utf-8", "replace")
    return error_response(error.status_code, "engine_error", "engine_rejected", text[:500])


def install_error_handlers(app: Any) -> None:
    """Typed bodies for schema errors (422), HTTP errors (their status) and anything unexpected (500)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Any, error: RequestValidationError) -> Any:
        return error_response(422, "invalid_request_error", "validation_error", "the request does not match the "
                              "schema", safe_details(list(error.errors())))

    @app.exception_handler(HTTPException)
    async def _http(_: Any, error: HTTPException) -> Any:
        code = "request_too_large" if error.status_code == 413 else f"http_{error.status_code}"
        return error_response(error.status_code, "invalid_request_error", code, str(error.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Any, error: Exception) -> Any:  # pragma: no cover - a bug; still a typed body
        return error_response(500, "internal_error", "internal_error", type(error).__name__)


class TenantResolver:
    """API key -> tenant. Keys are kept only as SHA-256 digests."""

    def __init__(self, api_keys: dict[str, str]) -> None:
        self._tenants = {hashlib.sha256(key.encode()).hexdigest(): tenant for key, tenant in api_keys.items()}

    def __call__(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer KEY`` header; None when the key is unknown or missing (every
        caller is ``default`` when no keys are configured)."""
        if not self._tenants:
            return DEFAULT_TENANT
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        token = authorization[7:].strip()
        return self._tenants.get(hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest())


class BodyLimit:
    """ASGI middleware: a request whose body is over ``max_bytes`` gets 413 without being read (by its
    ``Content-Length``) or as soon as the bytes read pass the limit (a chunked body). Other requests pass
    untouched."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"the request body is over the proxy's limit of {self.max_bytes} bytes (max_body_bytes)"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(413, "invalid_request_error", "request_too_large", self._message())
            await response(scope, receive, send)
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    from starlette.exceptions import HTTPException

                    raise HTTPException(status_code=413, detail=self._message())
            return message

        await self.app(scope, limited, send)
