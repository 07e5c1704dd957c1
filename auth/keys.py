"""API keys: the secret, its hash, and the record a store keeps (never the secret itself).

A key is `sk-sy-` + 256 random bits from the OS CSPRNG. Stores see only its SHA-256
hex digest; lookups go by digest and the final comparison uses `hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

KEY_PREFIX = "sk-sy-"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$", re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def same_hash(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("ascii"), b.encode("ascii"))


def _finite(value: float) -> float:
    """A float a JSON answer (and Redis) can hold; huge ints overflow, inf and NaN are none."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{str(value)[:40]} is out of range")
    return number


def parse_duration(value: Any) -> float | None:
    """Seconds from a number or `90s`, `15m`, `12h`, `30d`, `1w` (None stays None)."""
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return None if value is None else _finite(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"not a duration: {value!r} (examples: 3600, 90s, 15m, 12h, 30d, 1w)")
    seconds = float(match.group(1)) * _SECONDS[(match.group(2) or "s").lower()]
    if not math.isfinite(seconds):
        raise ValueError(f"duration {str(value)[:40]} is out of range")
    return seconds


def parse_instant(value: Any) -> float | None:
    """Epoch seconds from a number or an ISO 8601 date/time (naive means UTC)."""
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return None if value is None else _finite(value)
    if isinstance(value, datetime):
        moment = value
    else:
        moment = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC).timestamp()
    return moment.timestamp()


# "30d", "1h" or seconds; an ISO date or a Unix time. Shared by key records and updates.
Duration = Annotated[Annotated[float, Field(gt=0)] | None, BeforeValidator(parse_duration)]
# Limits are counted in Redis's Lua (doubles: exact below 2**53); a budget period shorter
# than a second or past a century cannot be windowed.
MAX_LIMIT = 2**53
MAX_PERIOD_S = 100 * 365 * 86400.0
Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT)]
Period = Annotated[Annotated[float, Field(ge=1, le=MAX_PERIOD_S)] | None,
                   BeforeValidator(parse_duration)]
Instant = Annotated[float | None, BeforeValidator(parse_instant)]


class KeyOptions(BaseModel):
    """What an operator sets on a key: its models, limits, expiry and disabled flag.

    Limits left unset are unlimited. `budget` is tokens (prompt + completion) per
    `budget_period` seconds, or in all when there is no period.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = ""
    models: list[str] | None = None  # None: every served model
    rpm: Limit | None = None
    tpm: Limit | None = None
    parallel: Limit | None = None
    budget: Limit | None = None
    budget_period: Period = None
    expires_at: Instant = None
    disabled: bool = False

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now or time.time()) >= self.expires_at


class KeyRecord(KeyOptions):
    """A stored key: its options plus identity. `key_hash` never leaves the server."""

    id: str
    key_hash: str
    created_at: float = Field(default_factory=time.time)

    def public(self) -> dict[str, Any]:
        return {"object": "api_key", **self.model_dump(exclude={"key_hash"})}


class KeyDeclaration(KeyOptions):
    """A key declared in the config file's `keys:` list, by the SHA-256 of its secret."""

    key_sha256: str
    id: str | None = None

    @field_validator("key_sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        value = value.strip().lower()
        if not _HEX64.match(value):
            raise ValueError("key_sha256 must be 64 hex digits (see `switchyard keys create "
                             "--offline`)")
        return value

    def record(self) -> KeyRecord:
        options = self.model_dump(exclude={"key_sha256", "id"})
        key_id = self.id or "key_" + self.key_sha256[:16]
        return KeyRecord(id=key_id, key_hash=self.key_sha256, created_at=0.0, **options)


def mint(options: KeyOptions) -> tuple[str, KeyRecord]:
    """A new secret and its record; the secret is returned once and never stored."""
    secret = new_secret()
    record = KeyRecord(id=new_key_id(), key_hash=hash_key(secret), **options.model_dump())
    return secret, record
