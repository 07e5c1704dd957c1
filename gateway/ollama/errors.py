"""Ollama's error shape `{"error": "message"}` on its routes (/api/...), with the gateway's
status: the `ollama` client raises `ResponseError` with that status and message. Every
failure answers so (gateway/error_shapes.py): auth, validation, admission, the backend's
refusals, unknown paths and methods, and the middlewares' answers (body limit, browser
guard, draining).

A stream that already started cannot change its status: a failure then is one more line,
`{"error": "message"}`, which the client raises as well.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from gateway.errors import OpenAIError, answer_json

PREFIX = "/api/"


def is_ollama_path(path: str) -> bool:
    return path.startswith(PREFIX)


def error_body(err: OpenAIError) -> dict[str, str]:
    message = err.message
    if err.param and err.param not in message:
        message = f"{message} (param: {err.param})"
    return {"error": message}


def error_response(err: OpenAIError) -> JSONResponse:
    return answer_json(error_body(err), err.status_code, err.headers)

