"""Which error shape a path answers in: the app's exception handlers ask (for what a route
or its auth dependency raises, an unknown path, a wrong method), and so do the middlewares
that answer themselves (the body limit, the browser guard, draining).

OpenAI's shape everywhere, but Anthropic's on the Messages routes and Ollama's under /api/
(TGI's routes are shaped where TGI's answers are made).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from gateway.anthropic import errors as anthropic
from gateway.errors import OpenAIError
from gateway.ollama import errors as ollama


def shaped_response(path: str, err: OpenAIError) -> JSONResponse | None:
    """The answer for `err` on `path` in its API's own shape; None for OpenAI's."""
    if path in anthropic.MESSAGES_PATHS:
        return anthropic.error_response(err)
    if ollama.is_ollama_path(path):
        return ollama.error_response(err)
    return None
