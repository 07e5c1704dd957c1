"""Stored responses in Redis, shared by every gateway replica: `sy:response:<id>` holds a
record's JSON and expires after --responses-ttl."""

from __future__ import annotations

from redis.asyncio import Redis

from auth.redis_conn import reachable
from gateway.responses_api.store import StoredResponse

PREFIX = "sy:response:"


class RedisResponseStore:
    def __init__(self, redis: Redis, ttl_s: float, where: str = "redis") -> None:
        self._redis = redis
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._where = where

    def describe(self) -> str:
        return self._where

    async def get(self, response_id: str) -> StoredResponse | None:
        with reachable("Redis"):
            text = await self._redis.get(PREFIX + response_id)
        return None if text is None else StoredResponse.from_json(text)

    async def put(self, record: StoredResponse) -> None:
        text = record.to_json()
        with reachable("Redis"):
            await self._redis.set(PREFIX + record.id, text, px=self._ttl_ms)

    async def delete(self, response_id: str) -> bool:
        with reachable("Redis"):
            return bool(await self._redis.delete(PREFIX + response_id))

    async def close(self) -> None:
        await self._redis.aclose()
