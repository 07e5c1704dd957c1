"""HTTP to an upstream: failures as DeploymentError / RequestError, and SSE.

Mapping: connect error 502 `upstream_unreachable`, timeout 504 `upstream_timeout`, 5xx 502
`upstream_error`, 429 429 with its Retry-After, 401/403/404 502 (our deployment is
misconfigured, not the client's request), any other 4xx a RequestError with the upstream's
status, message, param and code. An error event inside a stream is mapped the same way, by
the status its `code` or type stands for (`stream_error`). The pooled session itself is
`backends.remote.client`.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from backends.base import DeploymentError, RequestError
from backends.remote.limits import ERROR_BODY_BYTES, ResponseLimits, too_large
from backends.remote.redact import redact_text, redact_url

log = logging.getLogger(__name__)
MAX_RETRY_AFTER_S = 3600.0  # an upstream's Retry-After beyond an hour is clamped to it

_MISCONFIGURED = {401: "upstream_auth", 403: "upstream_auth", 404: "upstream_not_found"}


@contextmanager
def transport_errors(base_url: str) -> Iterator[None]:
    """aiohttp's failures (connecting, waiting, reading) as DeploymentErrors.

    The client's message names the failure, never the upstream's address: `base_url` goes,
    redacted, to the log only."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        _log_failure(base_url, exc)
        code = exc.os_error.errno  # its strerror may quote the address
        reason = os.strerror(code) if code else type(exc.os_error).__name__
        raise DeploymentError(f"cannot connect to the upstream ({reason})",
                              status_code=502, code="upstream_unreachable") from None
    except TimeoutError as exc:  # aiohttp's ServerTimeoutError (connect, read) is one
        raise DeploymentError(f"the upstream timed out ({type(exc).__name__})",
                              status_code=504, code="upstream_timeout") from None
    except (aiohttp.ClientError, HttpProcessingError) as exc:
        _log_failure(base_url, exc)
        raise DeploymentError(f"the connection to the upstream broke ({type(exc).__name__})",
                              status_code=502, code="upstream_error") from None


def _log_failure(base_url: str, exc: BaseException) -> None:
    # str(), not repr(): a ClientResponseError's repr carries the request headers, and with
    # them the upstream's API key.
    detail = str(exc).replace(base_url, redact_url(base_url))
    log.info("upstream %s: %s: %s", redact_url(base_url), type(exc).__name__,
                redact_text(detail))


def error_fields(raw: bytes) -> dict[str, Any]:
    """message / type / param / code from OpenAI's, TGI's or FastAPI's error bodies."""
    try:
        data = json.loads(raw)
    except ValueError:
        return {"message": raw.decode("utf-8", "replace").strip()[:500] or None}
    if not isinstance(data, dict):
        return {"message": str(data)[:500]}
    error = data.get("error")
    if isinstance(error, dict):  # OpenAI
        return {k: error.get(k) for k in ("message", "type", "param", "code")}
    if isinstance(error, str):  # TGI: {"error": ..., "error_type": ...}
        return {"message": error, "type": data.get("error_type")}
    detail = data.get("detail") or data.get("message")
    return {"message": detail if isinstance(detail, str) else json.dumps(data)[:500]}


def retry_after(headers: Mapping[str, str]) -> float | None:
    """An upstream's Retry-After, in seconds from now, within [0, MAX_RETRY_AFTER_S]; None
    when it gave none or nothing readable (`inf`, `nan`, garbage)."""
    value = headers.get("retry-after", "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = _http_date_seconds(value)
    if seconds is None or not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def _http_date_seconds(value: str) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    try:
        return when.timestamp() - time.time()
    except (OverflowError, ValueError, OSError):
        return None


def status_error(status: int, raw: bytes, headers: Mapping[str, str]) -> Exception:
    fields = error_fields(raw)
    message = str(fields.get("message") or f"HTTP {status}")
    code = fields.get("code")
    if status == 429:
        return DeploymentError(f"the upstream is rate limiting: {message}", status_code=429,
                               code="upstream_rate_limited", retry_after=retry_after(headers))
    if status >= 500 or status == 424:  # TGI answers a failed generation with 424
        return DeploymentError(f"the upstream failed ({status}): {message}", status_code=502,
                               code="upstream_error")
    if status in _MISCONFIGURED:
        return DeploymentError(f"the upstream refused the deployment ({status}): {message}",
                               status_code=502, code=_MISCONFIGURED[status])
    return RequestError(
        message, param=fields.get("param"), code=str(code) if code is not None else None,
        status_code=status, error_type=str(fields.get("type") or "invalid_request_error"),
    )


async def read_body(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or `upstream_too_large` once it passes `limit` bytes."""
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise too_large("the body", limit)
    return bytes(body)


async def read_error_body(response: aiohttp.ClientResponse) -> bytes:
    """The start of an error answer (enough for its message); the rest is not read."""
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) >= ERROR_BODY_BYTES:
            break
    return bytes(body[:ERROR_BODY_BYTES])


async def sse_data(response: aiohttp.ClientResponse, limits: ResponseLimits,
                   ) -> AsyncIterator[str]:
    """The `data` of each server-sent event, as chunks arrive (multi-line data joined).

    Lines are whole however the bytes were split across chunks; a line longer than
    `limits.max_line_bytes`, or an event longer than `limits.max_event_bytes`, ends the
    stream with `upstream_too_large` before it is held whole."""
    reader = _LineReader(limits.max_line_bytes)
    lines: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        for line in reader.feed(chunk):
            if not line:
                if lines:
                    yield _joined(lines)
                    lines, size = [], 0
                continue
            if line.startswith(b"data:"):
                data = line[5:].removeprefix(b" ")
                size += len(data) + 1
                if size > limits.max_event_bytes:
                    raise too_large("one stream event", limits.max_event_bytes)
                lines.append(data)
    tail = reader.rest()
    if tail.startswith(b"data:"):
        lines.append(tail[5:].removeprefix(b" "))
    if lines:
        yield _joined(lines)


def _joined(lines: list[bytes]) -> str:
    return b"\n".join(lines).decode("utf-8", "replace")


class _LineReader:
    """Bytes in, whole lines out (without their CR LF), each at most `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        start = len(self._buffer)
        self._buffer += chunk
        lines = []
        begin = 0
        while (end := self._buffer.find(b"\n", max(start, begin))) >= 0:
            line = bytes(self._buffer[begin:end]).rstrip(b"\r")
            if len(line) > self._limit:
                raise too_large("one stream line", self._limit)
            lines.append(line)
            begin = end + 1
        del self._buffer[:begin]
        if len(self._buffer) > self._limit:
            raise too_large("one stream line", self._limit)
        return lines

    def rest(self) -> bytes:
        return bytes(self._buffer).rstrip(b"\r")


def parse_json(data: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        raise malformed(f"a stream event is not JSON: {data[:200]!r}") from None
    if not isinstance(value, dict):
        raise malformed(f"a stream event is not a JSON object: {data[:200]!r}")
    return value


def malformed(message: str) -> DeploymentError:
    return DeploymentError(f"malformed upstream answer: {message}", status_code=502,
                           code="upstream_malformed")


# The HTTP status an error event's type stands for: OpenAI's and Switchyard's `type`, vLLM's
# and SGLang's exception names, TGI's `error_type`. Any other type is the upstream's failure.
_STATUS_BY_TYPE = {
    "invalid_request_error": 400, "BadRequestError": 400, "validation": 422,
    "NotFoundError": 404, "rate_limit_error": 429, "overloaded": 429,
}


def _event_status(data: dict[str, Any]) -> int:
    """vLLM and SGLang put the HTTP status in `code`; else the type says it."""
    error = data.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    kind = error.get("type") if isinstance(error, dict) else data.get("error_type")
    return _STATUS_BY_TYPE.get(str(kind), 500)


def stream_error(data: dict[str, Any]) -> Exception:
    """An `{"error": ...}` event in a stream answered 200, read as an answer with the status
    its type says: a RequestError when the request is at fault (it neither counts towards the
    deployment's cooldown nor moves to another deployment), else a DeploymentError."""
    status, raw = _event_status(data), json.dumps(data).encode()
    if status < 500:
        return status_error(status, raw, {})
    message = error_fields(raw).get("message")
    return DeploymentError(f"the upstream failed mid-stream: {message}", status_code=502,
                           code="upstream_error")
