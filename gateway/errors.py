"""Error answers: OpenAI's shape `{"error": {"message", "type", "param", "code"}}` everywhere,
TGI's `{"error": "...", "error_type": "..."}` on TGI's routes (see `tgi_error_response`).

Every handler also records why the request failed, for `tgi_request_failure{err}`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from auth.access import AccessDenied
from backends.base import BackendUnavailable, DeploymentError, RequestError
from gateway.metrics import failure_kind
from gateway.middleware import set_failure_label
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

    def failure_kind(self) -> str:
        if self.code == "request_aborted":
            return "aborted"
        return failure_kind(self.status_code, self.error_type)


class _AsciiJSONResponse(JSONResponse):
    """Errors may quote client input; ASCII escapes keep even broken unicode renderable."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def answer_json(body: dict[str, Any], status_code: int,
                headers: dict[str, str] | None = None) -> JSONResponse:
    """An error body of any API's shape, ASCII-escaped like OpenAI's."""
    return _AsciiJSONResponse(body, status_code=status_code, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


RETRY_AFTER_S = 1  # what an overloaded (429) or unready (503) answer suggests
MAX_RETRY_AFTER_S = 3600  # a longer wait (an upstream's) is answered as an hour


def retry_after_header(seconds: float) -> dict[str, str]:
    """`Retry-After` in whole seconds, 1 to an hour; RETRY_AFTER_S for a non-number."""
    if not math.isfinite(seconds):
        return {"Retry-After": str(RETRY_AFTER_S if math.isnan(seconds) else MAX_RETRY_AFTER_S)}
    return {"Retry-After": str(min(max(1, math.ceil(seconds)), MAX_RETRY_AFTER_S))}


def from_request_error(exc: RequestError) -> OpenAIError:
    """A backend's refusal; a 429 (overloaded) or one with `retry_after` says when to retry."""
    headers = None
    if exc.retry_after is not None:
        headers = retry_after_header(exc.retry_after)
    elif exc.status_code == 429:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return OpenAIError(
        exc.status_code, exc.message, param=exc.param, code=exc.code, error_type=exc.error_type,
        headers=headers,
    )


def from_model_not_found(exc: ModelNotFound) -> OpenAIError:
    return OpenAIError(404, exc.message, param="model", code="model_not_found")


def from_backend_unavailable(exc: BackendUnavailable) -> OpenAIError:
    message = str(exc) or "The model is not ready to serve requests; try again later."
    return OpenAIError(503, message, code="model_not_ready",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


def from_deployment_error(exc: DeploymentError) -> OpenAIError:
    """An upstream that failed: 502 (bad answer), 504 (timeout), 429 / 503 with Retry-After."""
    headers = None
    if exc.retry_after is not None:
        headers = retry_after_header(exc.retry_after)
    elif exc.status_code in (429, 503):
        headers = retry_after_header(RETRY_AFTER_S)
    error_type = "rate_limit_error" if exc.status_code == 429 else "api_error"
    return OpenAIError(exc.status_code, exc.message, error_type=error_type, code=exc.code,
                       headers=headers)


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


def to_openai_error(exc: Exception) -> OpenAIError | None:
    """The answer for an exception the gateway knows; None for anything else (a bug)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestError):
        return from_request_error(exc)
    if isinstance(exc, BackendUnavailable):
        return from_backend_unavailable(exc)
    if isinstance(exc, DeploymentError):
        return from_deployment_error(exc)
    if isinstance(exc, ModelNotFound):
        return from_model_not_found(exc)
    if isinstance(exc, AccessDenied):
        return from_access_denied(exc)
    if isinstance(exc, RequestValidationError | ValidationError):
        return from_validation_errors(list(exc.errors()))
    if isinstance(exc, StarletteHTTPException):
        message = str(exc.detail) if exc.detail else "HTTP error"
        code = "not_found" if exc.status_code == 404 else None
        return OpenAIError(exc.status_code, message, code=code, headers=exc.headers)
    return None


# TGI's error_type values its client understands, by our error type or status.
_TGI_OVERLOADED = "Model is overloaded"


def _tgi_status_and_type(err: OpenAIError) -> tuple[int, str]:
    if err.error_type == "overloaded":
        return 429, "overloaded"
    if err.status_code in (400, 413, 415, 422):
        return 422, "validation"  # TGI answers every input problem with 422
    if err.status_code >= 500 and err.status_code != 503:
        return err.status_code, "generation"
    return err.status_code, {
        401: "authentication", 403: "permission", 404: "not_found", 429: "rate_limit",
        503: "unavailable",
    }.get(err.status_code, err.error_type)


def tgi_error_response(err: OpenAIError) -> JSONResponse:
    """TGI's error shape `{"error": message, "error_type": kind}`, headers kept."""
    status, error_type = _tgi_status_and_type(err)
    message = _TGI_OVERLOADED if error_type == "overloaded" else err.message
    body = {"error": message, "error_type": error_type}
    return _AsciiJSONResponse(body, status_code=status, headers=err.headers)


def tgi_error_body(err: OpenAIError) -> dict[str, Any]:
    """The same, as one SSE event of a stream that already started."""
    return {"error": err.message, "error_type": _tgi_status_and_type(err)[1]}


# An API's own answer for an error on a path (gateway/error_shapes.py); None: OpenAI's.
PathShape = Callable[[str, OpenAIError], JSONResponse | None]


def answer(request: Request, err: OpenAIError, shape: PathShape | None = None) -> JSONResponse:
    """`err` in the path's API's shape (OpenAI's by default), noting why the request failed
    for the metrics."""
    set_failure_label(request.scope, err.failure_kind())
    shaped = shape(request.url.path, err) if shape is not None else None
    return shaped or err.response()


def install_error_handlers(app: FastAPI, shape: PathShape | None = None) -> None:
    async def known(request: Request, exc: Exception) -> JSONResponse:
        err = to_openai_error(exc)
        assert err is not None
        return answer(request, err, shape)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A server bug, never a client mistake: client input is validated before this point.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return answer(request, internal_error(), shape)

    for exc_type in (
        OpenAIError, RequestValidationError, ValidationError, StarletteHTTPException,
        ModelNotFound, RequestError, BackendUnavailable, DeploymentError, AccessDenied,
    ):
        app.add_exception_handler(exc_type, known)
    app.add_exception_handler(Exception, unexpected)
