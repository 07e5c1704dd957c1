"""Anthropic's error shape `{"type": "error", "error": {"type", "message"}}` on the Messages
routes, for every failure: auth (raised by the route's dependency), validation, admission,
the backend's refusals, and the middlewares' answers (body limit, browser guard, draining),
as gateway/error_shapes.py tells the app's handlers and the middlewares.

The gateway's errors (`OpenAIError`) keep their status; the type follows Anthropic's names
for it, so its SDK raises the matching exception class.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from gateway.errors import OpenAIError, answer_json

MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}


def error_type(err: OpenAIError) -> str:
    if err.error_type == "overloaded":  # the engine's full queue: still a 429 (Retry-After)
        return "overloaded_error"
    return _TYPE_BY_STATUS.get(err.status_code, "api_error")


def error_body(err: OpenAIError) -> dict[str, Any]:
    message = err.message
    if err.param and err.param not in message:
        message = f"{message} (param: {err.param})"
    return {"type": "error", "error": {"type": error_type(err), "message": message}}


def error_response(err: OpenAIError) -> JSONResponse:
    return answer_json(error_body(err), err.status_code, err.headers)

