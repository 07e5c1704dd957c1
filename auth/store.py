"""Key stores behind one protocol: in memory, from the config file, or in Redis."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from auth.keys import KeyRecord


class StoreUnavailable(Exception):
    """The store behind keys or limits cannot be reached (Redis down): a 503, not a 401."""


class ReadOnlyStore(Exception):
    """Keys declared in the config file change by editing the file, not through the API."""


class KeyStore(Protocol):
    async def find(self, key_hash: str) -> KeyRecord | None:
        """The key whose secret hashes to `key_hash`, if any."""
        ...

    async def get(self, key_id: str) -> KeyRecord | None: ...

    async def all(self) -> list[KeyRecord]: ...

    async def add(self, record: KeyRecord) -> None: ...

    async def replace(self, record: KeyRecord) -> bool:
        """Overwrite an existing key (same id); False if it no longer exists."""
        ...

    async def remove(self, key_id: str) -> KeyRecord | None: ...

    def describe(self) -> str:
        """Where the keys live, for the startup log (no secrets)."""
        ...


class MemoryKeyStore:
    """Keys in this process only: created through the admin API, gone on restart."""

    def __init__(self, records: Iterable[KeyRecord] = ()) -> None:
        self._by_id: dict[str, KeyRecord] = {}
        self._by_hash: dict[str, str] = {}
        for record in records:
            self._put(record)

    def _put(self, record: KeyRecord) -> None:
        if record.id in self._by_id or record.key_hash in self._by_hash:
            raise ValueError(f"duplicate key id or secret: {record.id}")
        self._by_id[record.id] = record
        self._by_hash[record.key_hash] = record.id

    async def find(self, key_hash: str) -> KeyRecord | None:
        key_id = self._by_hash.get(key_hash)
        return None if key_id is None else self._by_id.get(key_id)

    async def get(self, key_id: str) -> KeyRecord | None:
        return self._by_id.get(key_id)

    async def all(self) -> list[KeyRecord]:
        return list(self._by_id.values())

    async def add(self, record: KeyRecord) -> None:
        self._put(record)

    async def replace(self, record: KeyRecord) -> bool:
        old = self._by_id.get(record.id)
        if old is None:
            return False
        del self._by_hash[old.key_hash]
        self._by_id[record.id] = record
        self._by_hash[record.key_hash] = record.id
        return True

    async def remove(self, key_id: str) -> KeyRecord | None:
        record = self._by_id.pop(key_id, None)
        if record is not None:
            del self._by_hash[record.key_hash]
        return record

    def describe(self) -> str:
        return f"memory ({len(self._by_id)} keys; created through /admin/keys, lost on restart)"


class FileKeyStore(MemoryKeyStore):
    """Keys declared (hashed) in the config file: read-only while the gateway runs."""

    async def add(self, record: KeyRecord) -> None:
        raise ReadOnlyStore("keys are declared in the config file; edit it and restart")

    async def replace(self, record: KeyRecord) -> bool:
        raise ReadOnlyStore("keys are declared in the config file; edit it and restart")

    async def remove(self, key_id: str) -> KeyRecord | None:
        raise ReadOnlyStore("keys are declared in the config file; edit it and restart")

    def describe(self) -> str:
        return f"the config file ({len(self._by_id)} keys, read-only)"
