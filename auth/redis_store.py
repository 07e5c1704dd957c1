"""Keys in Redis, shared by every gateway replica.

`sy:key:<sha256>` holds a key's JSON record (one GET per request); the hash
`sy:keys` maps id -> sha256 for the admin side. A lookup always reads Redis, so
revocation, expiry and disabling take effect on every replica at once. Every key is under
`sy:`, the prefix the shipped Redis's ACL limits the gateway's user to.
"""

from __future__ import annotations

from redis.asyncio import Redis

from auth.keys import KeyRecord
from auth.redis_conn import reachable

INDEX = "sy:keys"


def _record_key(key_hash: str) -> str:
    return f"sy:key:{key_hash}"


def _load(raw: str | None) -> KeyRecord | None:
    return None if raw is None else KeyRecord.model_validate_json(raw)


class RedisKeyStore:
    def __init__(self, redis: Redis, where: str = "redis") -> None:
        self._redis = redis
        self._where = where

    async def find(self, key_hash: str) -> KeyRecord | None:
        with reachable():
            return _load(await self._redis.get(_record_key(key_hash)))

    async def get(self, key_id: str) -> KeyRecord | None:
        with reachable():
            key_hash = await self._redis.hget(INDEX, key_id)
            if key_hash is None:
                return None
            return _load(await self._redis.get(_record_key(key_hash)))

    async def all(self) -> list[KeyRecord]:
        with reachable():
            hashes = await self._redis.hvals(INDEX)
            if not hashes:
                return []
            raws = await self._redis.mget([_record_key(h) for h in hashes])
        records = [_load(raw) for raw in raws]
        return sorted((r for r in records if r is not None), key=lambda r: r.created_at)

    async def add(self, record: KeyRecord) -> None:
        with reachable():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(_record_key(record.key_hash), record.model_dump_json(), nx=True)
                pipe.hsetnx(INDEX, record.id, record.key_hash)
                created, indexed = await pipe.execute()
        if not (created and indexed):
            raise ValueError(f"duplicate key id or secret: {record.id}")

    async def replace(self, record: KeyRecord) -> bool:
        with reachable():
            # XX: an update racing a revocation must not bring the key back.
            done = await self._redis.set(
                _record_key(record.key_hash), record.model_dump_json(), xx=True)
        return bool(done)

    async def remove(self, key_id: str) -> KeyRecord | None:
        record = await self.get(key_id)
        if record is None:
            return None
        with reachable():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(_record_key(record.key_hash))
                pipe.hdel(INDEX, key_id)
                await pipe.execute()
        return record

    def describe(self) -> str:
        return self._where
