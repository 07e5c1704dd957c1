"""Stored responses: each with its owner and the conversation that led to it.

A record holds the response object and its input items (the previous response's items, when
it continued one, then the request's own), and belongs to the caller that made it: an API
key, the admin key, or nobody (open mode). Another caller gets the 404 an unknown id gets.
Records live in Redis when the gateway has one (shared by replicas), else in SQLite under
the cache directory (in memory when the cache is off); both expire after --responses-ttl.
A record over `MAX_RECORD_BYTES` is not stored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from auth.access import Principal
from auth.store import StoreUnavailable
from gateway.errors import OpenAIError

log = logging.getLogger("switchyard.gateway")
JSON = dict[str, Any]
MAX_RECORD_BYTES = 16 * 1024**2
DEFAULT_TTL_S = 30 * 24 * 3600.0


class RecordTooLarge(ValueError):
    """A response whose record would pass MAX_RECORD_BYTES."""


def owner_of(principal: Principal) -> str:
    """Who a response made by `principal` belongs to."""
    if principal.key_id is not None:
        return f"key:{principal.key_id}"
    return "admin" if principal.admin else "anonymous"


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    response: JSON
    input_items: list[JSON]

    @property
    def id(self) -> str:
        return str(self.response["id"])

    def to_json(self) -> str:
        text = json.dumps({"owner": self.owner, "response": self.response,
                           "input_items": self.input_items}, ensure_ascii=False,
                          separators=(",", ":"))
        if len(text.encode()) > MAX_RECORD_BYTES:
            raise RecordTooLarge(f"response {self.id} is larger than {MAX_RECORD_BYTES} bytes")
        return text

    @classmethod
    def from_json(cls, text: str) -> StoredResponse:
        data = json.loads(text)
        return cls(data["owner"], data["response"], data["input_items"])


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, record: StoredResponse) -> None:
        """Store (or replace) `record`; StoreUnavailable or RecordTooLarge when it cannot."""
        ...

    async def delete(self, response_id: str) -> bool: ...

    async def close(self) -> None: ...


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"No response found with id '{response_id}'.", param=param,
                       code="response_not_found")


def unavailable(exc: StoreUnavailable) -> OpenAIError:
    return OpenAIError(503, f"Stored responses cannot be reached: {exc}; try again later.",
                       code="store_unavailable", headers={"Retry-After": "1"})


async def owned(store: ResponseStore, owner: str, response_id: str,
                param: str | None = None) -> StoredResponse:
    """The caller's stored response, or the 404 of an unknown one."""
    try:
        record = await store.get(response_id)
    except StoreUnavailable as exc:
        raise unavailable(exc) from exc
    if record is None or record.owner != owner:
        raise not_found(response_id, param)
    return record


async def delete_owned(store: ResponseStore, owner: str, response_id: str) -> None:
    await owned(store, owner, response_id)
    try:
        await store.delete(response_id)
    except StoreUnavailable as exc:
        raise unavailable(exc) from exc


async def keep(store: ResponseStore, record: StoredResponse) -> bool:
    """Store `record`; False (logged) when it cannot be: the answer then says `store: false`."""
    try:
        await store.put(record)
    except (StoreUnavailable, RecordTooLarge) as exc:
        log.warning("response %s was not stored: %s", record.id, exc)
        return False
    return True
