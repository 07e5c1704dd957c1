"""The stores' bounds: on a real SQLite file, records expire after the TTL, the oldest go past
the size cap, a record over MAX_RECORD_BYTES or a store that cannot be written is not kept
(the answer then says `store: false`), and another owner's record is a 404; a Redis that
cannot be reached is a 503 for reads and keeps nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from auth.redis_conn import connect
from gateway.errors import OpenAIError
from gateway.responses_api.disk_store import FILE_NAME, DiskResponseStore
from gateway.responses_api.redis_store import RedisResponseStore
from gateway.responses_api.store import MAX_RECORD_BYTES, StoredResponse, keep, owned
from tests.auth.conftest import free_port


def _record(number: int, text: str = "x", owner: str = "key:a") -> StoredResponse:
    return StoredResponse(owner, {"id": f"resp_{number}", "output": [text]}, [])


def test_records_expire_after_the_ttl(tmp_path: Path) -> None:
    async def run() -> None:
        store = DiskResponseStore(tmp_path, ttl_s=0.3)
        await store.put(_record(1))
        assert (await store.get("resp_1")) == _record(1)
        await asyncio.sleep(0.4)
        assert await store.get("resp_1") is None
        await store.close()
    asyncio.run(run())


def test_past_the_size_cap_the_oldest_records_go(tmp_path: Path) -> None:
    size = len(_record(0, "y" * 1000).to_json().encode())

    async def run() -> None:
        store = DiskResponseStore(tmp_path, ttl_s=60, max_bytes=3 * size)
        for number in range(5):
            await store.put(_record(number, "y" * 1000))
            time.sleep(0.01)  # distinct expiry times: the order of writing
        kept = [n for n in range(5) if await store.get(f"resp_{n}") is not None]
        assert kept == [2, 3, 4]
        await store.close()
    asyncio.run(run())


def test_a_record_over_the_cap_or_an_unwritable_store_is_not_kept(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")

    async def run() -> None:
        store = DiskResponseStore(tmp_path, ttl_s=60)
        assert not await keep(store, _record(1, "z" * MAX_RECORD_BYTES))
        assert await store.get("resp_1") is None
        assert await keep(store, _record(2))
        broken = DiskResponseStore(tmp_path / "file", ttl_s=60)
        assert not await keep(broken, _record(3))
        await store.close()
    asyncio.run(run())
    assert (tmp_path / FILE_NAME).exists()


def test_another_owners_record_is_a_404(tmp_path: Path) -> None:
    async def run() -> None:
        store = DiskResponseStore(None, ttl_s=60)  # the cache directory off: in memory
        await store.put(_record(1, owner="key:a"))
        assert (await owned(store, "key:a", "resp_1")).owner == "key:a"
        for owner in ("key:b", "admin", "anonymous"):
            with pytest.raises(OpenAIError) as caught:
                await owned(store, owner, "resp_1")
            assert caught.value.status_code == 404
    asyncio.run(run())


def test_an_unreachable_redis_is_a_503_and_answers_are_not_kept() -> None:
    async def run() -> None:
        store = RedisResponseStore(connect(f"redis://127.0.0.1:{free_port()}/0"), ttl_s=60)
        assert not await keep(store, _record(1))
        with pytest.raises(OpenAIError) as caught:
            await owned(store, "key:a", "resp_1")
        assert caught.value.status_code == 503 and caught.value.code == "store_unavailable"
        await store.close()
    asyncio.run(run())
