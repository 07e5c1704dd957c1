"""The key administration API's bodies, as documented (OpenAPI).

The routes parse bodies with `auth.admin.NewKey` / `KeyChanges` (unknown fields refused);
these models describe them with the spellings those parsers accept.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from auth.keys import MAX_LIMIT, MAX_PERIOD_S

Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT)]
_UNITS = Field(pattern=r"^\s*[0-9]+(\.[0-9]+)?\s*(ms|s|m|h|d|w|MS|S|M|H|D|W)?\s*$")
Duration = Annotated[float, Field(gt=0)] | Annotated[str, _UNITS]
Period = Annotated[float, Field(ge=1, le=MAX_PERIOD_S)] | Annotated[str, _UNITS]
Instant = float | Annotated[str, Field(json_schema_extra={"format": "date-time"})]
_DURATION = "Seconds, or a number with a unit: 90s, 15m, 12h, 30d, 1w."


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""
    models: list[str] | None = Field(None, description="Null: every served model.")
    rpm: Limit | None = Field(None, description="Requests per minute.")
    tpm: Limit | None = Field(None, description="Tokens per minute.")
    parallel: Limit | None = Field(None, description="Requests in flight at once.")
    budget: Limit | None = Field(None, description="Tokens per budget_period (or ever).")
    budget_period: Period | None = Field(None, description=_DURATION + " At least 1s.")
    expires_at: Instant | None = Field(None, description="Unix time or an ISO 8601 date/time.")


class NewKeyRequest(_Options):
    """POST /admin/keys: leave out whatever should stay unlimited."""

    expires_in: Duration | None = Field(None, description=_DURATION)
    disabled: bool = False


class KeyChangesRequest(_Options):
    """PATCH /admin/keys/{key_id}: only the fields sent change."""

    name: str | None = None  # type: ignore[assignment]
    disabled: bool | None = Field(None, description="true or false; never null.")


class ApiKey(BaseModel):
    object: Literal["api_key"]
    id: str
    name: str
    models: list[str] | None
    rpm: int | None
    tpm: int | None
    parallel: int | None
    budget: int | None
    budget_period: float | None
    expires_at: float | None
    disabled: bool
    created_at: float


class NewApiKey(ApiKey):
    key: str = Field(description="The secret, shown this once.")


class ApiKeyList(BaseModel):
    object: Literal["list"]
    data: list[ApiKey]


class DeletedApiKey(BaseModel):
    id: str
    object: Literal["api_key"]
    deleted: Literal[True]


class ModelUsage(BaseModel):
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Budget(BaseModel):
    limit: int
    used: int
    remaining: int
    period_s: float | None
    resets_in_s: float | None


class KeyUsage(BaseModel):
    object: Literal["key.usage"]
    key_id: str
    name: str
    data: list[ModelUsage]
    budget: Budget | None
