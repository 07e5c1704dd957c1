"""Who may call the gateway. Today: open mode only (no keys configured).

A later issue adds API keys, stores and limits behind the same `AccessPolicy`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("switchyard.auth")


class AccessDenied(Exception):
    """A request the policy refuses: 401 (no/bad key), 403 (model not allowed), 429 (limits)."""

    def __init__(
        self, message: str, *, status_code: int = 401, code: str | None = "invalid_api_key",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.retry_after = retry_after


@dataclass(frozen=True)
class Principal:
    """The caller a request runs as."""

    key_id: str | None  # None in open mode


class AccessPolicy(Protocol):
    def announce(self) -> None:
        """Log, once at startup, how requests are authorized."""
        ...

    async def authenticate(self, api_key: str | None) -> Principal:
        """The caller a bearer token belongs to, or `AccessDenied` (checked before the body)."""
        ...

    async def authorize(self, principal: Principal, model: str) -> None:
        """Raise `AccessDenied` if `principal` may not use `model` now."""
        ...


class OpenAccess:
    """No keys configured: every request is allowed, whatever bearer token it carries."""

    def announce(self) -> None:
        log.warning(
            "NO API KEYS CONFIGURED: the gateway runs in OPEN MODE and serves every request "
            "without authentication. Do not expose it beyond a trusted network."
        )

    async def authenticate(self, api_key: str | None) -> Principal:
        return Principal(key_id=None)

    async def authorize(self, principal: Principal, model: str) -> None:
        return None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if any."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
