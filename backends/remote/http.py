"""HTTP to an upstream: failures as DeploymentError / RequestError, and SSE.

Mapping: connect error 502 `upstream_unreachable`, timeout 504 `upstream_timeout`, 5xx 502
`upstream_error`, 429 429 with its Retry-After, 401/403/404 502 (our deployment is
misconfigured, not the client's request), any other 4xx a RequestError with the upstream's
status, message, param and code. The pooled session itself is `backends.remote.client`.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from backends.base import DeploymentError, RequestError

_MISCONFIGURED = {401: "upstream_auth", 403: "upstream_auth", 404: "upstream_not_found"}


@contextmanager
def transport_errors(base_url: str) -> Iterator[None]:
    """aiohttp's failures (connecting, waiting, reading) as DeploymentErrors."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        raise DeploymentError(f"cannot connect to the upstream {base_url}: {exc}",
                              status_code=502, code="upstream_unreachable") from None
    except TimeoutError as exc:  # aiohttp's ServerTimeoutError (connect, read) is one
        kind = type(exc).__name__
        raise DeploymentError(f"the upstream {base_url} timed out ({kind})",
                              status_code=504, code="upstream_timeout") from None
    except (aiohttp.ClientError, HttpProcessingError) as exc:
        # str(), not repr(): a ClientResponseError's repr carries the request headers, and
        # with them the upstream's API key.
        raise DeploymentError(f"the connection to the upstream {base_url} broke: "
                              f"{type(exc).__name__}: {exc}",
                              status_code=502, code="upstream_error") from None


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
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


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


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The `data` of each server-sent event, as chunks arrive (multi-line data joined).

    The StreamReader's lines are whole however the bytes were split across chunks."""
    lines: list[str] = []
    async for raw in response.content:
        line = raw.rstrip(b"\r\n")
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
            continue
        if line.startswith(b"data:"):
            lines.append(line[5:].removeprefix(b" ").decode("utf-8", "replace"))
    if lines:
        yield "\n".join(lines)


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


def stream_error(data: dict[str, Any]) -> DeploymentError:
    """An `{"error": ...}` event inside a stream that had started fine."""
    message = error_fields(json.dumps(data).encode()).get("message")
    return DeploymentError(f"the upstream failed mid-stream: {message}", status_code=502,
                           code="upstream_error")
