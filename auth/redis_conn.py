"""One asyncio Redis client per process, failing fast when Redis is away.

Timeouts are short so a dead Redis turns into a quick 503, and a single immediate
retry on connection errors lets a stale pooled connection (Redis restarted) be
replaced without the caller noticing. Timeouts are not retried: the command may
have run, and admission must not be taken twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import unquote, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from auth.store import StoreUnavailable

CONNECT_TIMEOUT_S = 0.5
COMMAND_TIMEOUT_S = 1.0


def connect(url: str) -> Redis:
    """A lazily connecting client (no I/O here), strings decoded."""
    return Redis.from_url(
        url, decode_responses=True, socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=COMMAND_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )


def redacted(url: str) -> str:
    """The URL without its secrets, for logs: the userinfo (`user:password@`, or a lone token
    in the user's place) and the values of `password` query parameters become `***`."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = "&".join(_redacted_parameter(p) for p in parts.query.split("&")) if parts.query else ""
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _redacted_parameter(parameter: str) -> str:
    name, equals, _ = parameter.partition("=")
    return f"{name}=***" if equals and unquote(name).lower() == "password" else parameter


@contextmanager
def reachable(what: str = "Redis") -> Iterator[None]:
    """Turn connection-level Redis failures into `StoreUnavailable`."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise StoreUnavailable(f"{what} is unreachable: {type(exc).__name__}") from exc
