"""One access line per HTTP request, written when the request really ends (for a stream:
when its last byte is sent, with its token counts). MetricsMiddleware calls `log_access`.

The line's fields (JSON logs carry them as keys; text logs as `key=value` in the message):
`request_id` (the client's `x-request-id` when sane, else ours; sent back as `x-request-id`),
`generation_id` (the response body's `id`), `method`, `path`, `status`, `key_id` (the API
key's id, never the key; "admin" for the admin key; null in open mode), `model`,
`deployment`, `prompt_tokens`, `completion_tokens`, `queue_s`, `ttft_s`, `total_s` and
`error` (the failure kind). `/health` and `/metrics` polls are logged at debug only.

The text line escapes what a client controls (the decoded path, names): control and other
unprintable characters, spaces and backslashes become `\\xNN` / `\\uNNNN`, so a path
like `/%0Afake` stays on its line and cannot forge another. JSON lines keep the raw values
(json escapes them itself).
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from starlette.types import Scope

from gateway.log_format import FIELDS_ATTR
from gateway.metrics import RequestLabels

log = logging.getLogger("switchyard.access")
QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled: debug level only
REQUEST_ID_HEADER = b"x-request-id"
_SANE_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id(scope: Scope) -> str:
    """The client's x-request-id when it is a plain token, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            given = value.decode("latin-1")
            if _SANE_ID.match(given):
                return given
    return f"req-{uuid.uuid4().hex}"


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def access_fields(scope: Scope, labels: RequestLabels, elapsed: float) -> dict[str, Any]:
    return {
        "request_id": labels.request_id,
        "generation_id": labels.generation_id,
        "method": scope.get("method"),
        "path": scope.get("path"),
        "status": labels.status,
        "key_id": labels.key_id,
        "model": labels.model or None,
        "deployment": labels.deployment,
        "prompt_tokens": labels.prompt_tokens,
        "completion_tokens": labels.completion_tokens,
        "queue_s": _seconds(labels.queue_s),
        "ttft_s": _seconds(labels.ttft_s),
        "total_s": _seconds(elapsed),
        "error": labels.error,
    }


def escaped(value: object) -> str:
    """`value` as one unambiguous word of a text log line (see the module doc)."""
    text = str(value)
    if text.isprintable() and " " not in text and "\\" not in text:
        return text
    return "".join(_escape(c) for c in text)


def _escape(char: str) -> str:
    if char.isprintable() and char not in " \\":
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


def _text(fields: dict[str, Any]) -> str:
    head = " ".join(escaped(fields[k]) for k in ("method", "path", "status"))
    rest = " ".join(f"{k}={escaped(v)}" for k, v in fields.items()
                    if k not in ("method", "path", "status") and v is not None)
    return f"{head} {rest}"


def log_access(scope: Scope, labels: RequestLabels, elapsed: float) -> None:
    level = logging.DEBUG if scope.get("path") in QUIET_PATHS else logging.INFO
    if not log.isEnabledFor(level):
        return
    fields = access_fields(scope, labels, elapsed)
    log.log(level, "%s", _text(fields), extra={FIELDS_ATTR: {"access": True, **fields}})
