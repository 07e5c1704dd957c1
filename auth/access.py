"""Who may call the gateway, and how much: the AccessPolicy protocol and open mode.

A request meets the policy three times: `authenticate` (the bearer key, before the
body is read: 401), `admit` (the model is allowed, 403; the limits have room, 429;
tokens are reserved) and, when it ends however it ends, `Admission.settle` with
what it really used. `auth.policy.KeyAccess` is the policy with keys.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from auth.keys import KeyRecord
from auth.limits import Consumed

if TYPE_CHECKING:
    from auth.admin import KeyAdmin

log = logging.getLogger("switchyard.auth")

# Prompt + max new tokens: awaited only when the key's limits count tokens.
TokenEstimate = Callable[[], Awaitable[int]]


class AccessDenied(Exception):
    """A request the policy refuses: 401 (no/bad key), 403 (model not allowed), 429 (limits),
    503 (the key store is unreachable)."""

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

    key_id: str | None  # None in open mode, for the admin key, and when failing open
    key: KeyRecord | None = field(default=None, compare=False)
    admin: bool = False

    def may_use(self, model: str) -> bool:
        return self.key is None or self.key.models is None or model in self.key.models


class Admission(Protocol):
    """An admitted request: the headers to answer with, and the settlement at its end."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def settle(self, used: Consumed) -> None:
        """Reconcile the reservation with what was used. Idempotent; never raises."""
        ...


class FreeAdmission:
    """Nothing reserved, nothing to settle."""

    headers: Mapping[str, str] = {}

    async def settle(self, used: Consumed) -> None:
        return None


class AccessPolicy(Protocol):
    def announce(self) -> None:
        """Log, once at startup, how requests are authorized."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def authenticate(self, api_key: str | None) -> Principal:
        """The caller a bearer token belongs to, or `AccessDenied` (checked before the body)."""
        ...

    async def authorize(self, principal: Principal, model: str) -> None:
        """Raise `AccessDenied` (403) if `principal` may not use `model` (admit checks it too)."""
        ...

    async def admit(self, principal: Principal, model: str, estimate: TokenEstimate) -> Admission:
        """Check the model is allowed and the limits have room; reserve; or `AccessDenied`."""
        ...

    def key_admin(self) -> KeyAdmin | None:
        """Key administration, where keys are enabled."""
        ...


class OpenAccess:
    """No keys configured: every request is allowed, whatever bearer token it carries."""

    def announce(self) -> None:
        log.warning(
            "NO API KEYS CONFIGURED: the gateway runs in OPEN MODE and serves every request "
            "without authentication. Do not expose it beyond a trusted network. Set an admin "
            "key (--admin-key), a Redis URL (--redis-url) or keys in the config file to "
            "require API keys."
        )

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def authenticate(self, api_key: str | None) -> Principal:
        return Principal(key_id=None)

    async def authorize(self, principal: Principal, model: str) -> None:
        return None

    async def admit(self, principal: Principal, model: str, estimate: TokenEstimate) -> Admission:
        return FreeAdmission()

    def key_admin(self) -> KeyAdmin | None:
        return None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if any."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
