"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every failure."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from auth.access import AccessDenied
from backends.base import BackendUnavailable, RequestError
from routing.errors import ModelNotFound

log = logging.getLogger("switchyard.gateway")

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
    415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """Any failure the gateway answers with OpenAI's error body."""

    def __init__(
        self, status_code: int, message: str, *, param: str | None = None,
        code: str | None = None, error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, "api_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {
            "message": self.message, "type": self.error_type, "param": self.param,
            "code": self.code,
        }}

    def response(self) -> JSONResponse:
        return _AsciiJSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class _AsciiJSONResponse(JSONResponse):
    """Errors may quote client input; ASCII escapes keep even broken unicode renderable."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_request_error(exc: RequestError) -> OpenAIError:
    return OpenAIError(
        exc.status_code, exc.message, param=exc.param, code=exc.code, error_type=exc.error_type,
    )


def from_model_not_found(exc: ModelNotFound) -> OpenAIError:
    return OpenAIError(404, exc.message, param="model", code="model_not_found")


def from_backend_unavailable(exc: BackendUnavailable) -> OpenAIError:
    message = str(exc) or "The model is not ready to serve requests; try again later."
    return OpenAIError(503, message, code="model_not_ready", headers={"Retry-After": "1"})


def from_access_denied(exc: AccessDenied) -> OpenAIError:
    headers = None
    if exc.retry_after is not None:
        headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
    return OpenAIError(exc.status_code, exc.message, code=exc.code, headers=headers)


def internal_error() -> OpenAIError:
    return OpenAIError(500, "The server had an error while processing your request.",
                       error_type="api_error", code="internal_error")


def param_path(loc: Sequence[int | str]) -> str | None:
    """`("messages", 0, "role")` -> `"messages[0].role"`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


_CODE_BY_PYDANTIC = {
    "missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter",
}


def from_validation_errors(errors: Sequence[Any]) -> OpenAIError:
    """The first pydantic error, naming the field as OpenAI's `param`."""
    first = errors[0] if errors else {"loc": (), "msg": "Invalid request", "type": "value_error"}
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = param_path(loc)
    message = first.get("msg", "Invalid request")
    if param:
        message = f"Invalid value for '{param}': {message}"
    code = _CODE_BY_PYDANTIC.get(first.get("type", ""), "invalid_value")
    if first.get("type", "").endswith("_type") or first.get("type") == "model_attributes_type":
        code = "invalid_type"
    return OpenAIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(ValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(ModelNotFound, _typed(from_model_not_found))
    app.add_exception_handler(RequestError, _typed(from_request_error))
    app.add_exception_handler(BackendUnavailable, _typed(from_backend_unavailable))
    app.add_exception_handler(AccessDenied, _typed(from_access_denied))
    app.add_exception_handler(Exception, _unexpected)


def _typed(convert: Any) -> Any:
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        return convert(exc).response()
    return handler


async def _openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _request_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return from_validation_errors(list(exc.errors())).response()


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail) if exc.detail else "HTTP error"
    code = "not_found" if exc.status_code == 404 else None
    return OpenAIError(exc.status_code, message, code=code, headers=exc.headers).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A server bug, never a client mistake: client input is validated before this point.
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return internal_error().response()
