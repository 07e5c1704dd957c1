"""Key administration, shared by the /admin/keys endpoints and `switchyard keys`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from auth.keys import Duration, Instant, KeyOptions, KeyRecord, Limit, Period, mint
from auth.limits import Limiter, Limits
from auth.store import KeyStore


class KeyNotFound(LookupError):
    def __init__(self, key_id: str) -> None:
        super().__init__(key_id)
        self.message = f"No API key with id {key_id!r}."


class NewKey(KeyOptions):
    """A create request: the options, with the expiry as `expires_at` or `expires_in`."""

    expires_in: Duration = None

    def options(self, now: float) -> KeyOptions:
        values = self.model_dump(exclude={"expires_in"})
        if self.expires_in is not None:
            values["expires_at"] = now + self.expires_in
        return KeyOptions(**values)


class KeyChanges(BaseModel):
    """A partial update: only the fields sent change (`models: null` means every model)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    models: list[str] | None = None
    rpm: Limit | None = None
    tpm: Limit | None = None
    parallel: Limit | None = None
    budget: Limit | None = None
    budget_period: Period = None
    expires_at: Instant = None
    disabled: bool | None = None

    @model_validator(mode="after")
    def _no_null_flags(self) -> KeyChanges:
        if "disabled" in self.model_fields_set and self.disabled is None:
            raise ValueError("disabled must be true or false")
        return self


class KeyAdmin:
    def __init__(
        self, store: KeyStore, limiter: Limiter, clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.limiter = limiter
        self._clock = clock

    async def create(self, spec: NewKey) -> tuple[str, KeyRecord]:
        """A new key; the secret is in the answer and nowhere else."""
        secret, record = mint(spec.options(self._clock()))
        await self.store.add(record)
        return secret, record

    async def list(self) -> list[KeyRecord]:
        return await self.store.all()

    async def get(self, key_id: str) -> KeyRecord:
        record = await self.store.get(key_id)
        if record is None:
            raise KeyNotFound(key_id)
        return record

    async def update(self, key_id: str, changes: KeyChanges) -> KeyRecord:
        record = await self.get(key_id)
        values = {**record.model_dump(), **changes.model_dump(exclude_unset=True)}
        updated = KeyRecord.model_validate(values)
        if not await self.store.replace(updated):
            raise KeyNotFound(key_id)
        return updated

    async def revoke(self, key_id: str) -> KeyRecord:
        record = await self.store.remove(key_id)
        if record is None:
            raise KeyNotFound(key_id)
        return record

    async def usage(self, record: KeyRecord) -> dict[str, Any]:
        """Requests and tokens per model, and the budget, of one key."""
        limits = Limits.of(record)
        usage = await self.limiter.usage(record.id, limits)
        budget = None
        if limits.budget:
            budget = {"limit": limits.budget, "used": usage.budget_used,
                      "remaining": max(limits.budget - usage.budget_used, 0),
                      "period_s": limits.budget_period_s, "resets_in_s": usage.budget_reset_s}
        data = [u.as_dict(model) for model, u in sorted(usage.models.items())]
        return {"object": "key.usage", "key_id": record.id, "name": record.name, "data": data,
                "budget": budget}
