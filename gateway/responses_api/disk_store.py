"""Stored responses in SQLite: one file under the cache directory, shared by the processes
that share the directory, kept across restarts (or in memory when the cache is off).

The file is opened on first use, so a gateway that never stores a response never creates it.
Calls run in a worker thread, one at a time. Expired records are skipped when read and purged
when writing; past `MAX_STORE_BYTES` the oldest records go first.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from auth.store import StoreUnavailable
from gateway.responses_api.store import StoredResponse

T = TypeVar("T")
FILE_NAME = "responses.sqlite3"
MAX_STORE_BYTES = 1024**3
BUSY_TIMEOUT_S = 5.0
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, record TEXT NOT NULL, "
    "size INTEGER NOT NULL, expires_at REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at)",
)


class DiskResponseStore:
    def __init__(self, folder: Path | None, ttl_s: float,
                 max_bytes: int = MAX_STORE_BYTES) -> None:
        self._path = ":memory:" if folder is None else str(folder / FILE_NAME)
        self._folder = folder
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self._path

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            if self._folder is not None:
                self._folder.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                 isolation_level=None)
            if self._folder is not None:
                db.execute("PRAGMA journal_mode=WAL")
            for statement in _SCHEMA:
                db.execute(statement)
            self._db = db
        return self._db

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            with self._lock:
                try:
                    return work(self._connection())
                except (sqlite3.Error, OSError) as exc:
                    raise StoreUnavailable(f"{self._path}: {exc}") from exc
        return await asyncio.to_thread(locked)

    async def get(self, response_id: str) -> StoredResponse | None:
        def read(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT record FROM responses WHERE id = ? AND expires_at > ?",
                             (response_id, time.time())).fetchone()
            return None if row is None else str(row[0])
        text = await self._run(read)
        return None if text is None else StoredResponse.from_json(text)

    async def put(self, record: StoredResponse) -> None:
        text = record.to_json()
        size = len(text.encode())

        def write(db: sqlite3.Connection) -> None:
            now = time.time()
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                           (record.id, text, size, now + self._ttl_s))
                self._evict(db)
        await self._run(write)

    def _evict(self, db: sqlite3.Connection) -> None:
        """Past the size cap, the records that expire first (the oldest) go."""
        total = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
        if total <= self._max_bytes:
            return
        doomed: list[tuple[str]] = []
        for response_id, size in db.execute(
                "SELECT id, size FROM responses ORDER BY expires_at"):
            if total <= self._max_bytes:
                break
            doomed.append((response_id,))
            total -= size
        db.executemany("DELETE FROM responses WHERE id = ?", doomed)

    async def delete(self, response_id: str) -> bool:
        def remove(db: sqlite3.Connection) -> bool:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
        return await self._run(remove)

    async def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
