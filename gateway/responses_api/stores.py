"""The stored responses' backing store the settings ask for, kept on the app."""

from __future__ import annotations

import logging

from fastapi import Request

from backends.machine.cache_dir import DEFAULT_CACHE_DIR, cache_root
from gateway.responses_api.disk_store import DiskResponseStore
from gateway.responses_api.store import ResponseStore
from gateway.settings import Settings

log = logging.getLogger("switchyard.gateway")
STATE_ATTR = "responses_store"


def open_store(settings: Settings) -> ResponseStore:
    """Redis when the gateway has one (replicas share it), else SQLite under the cache
    directory (in memory with the cache off). Nothing is opened or connected here."""
    if settings.redis_url:
        from auth.redis_conn import connect, redacted
        from gateway.responses_api.redis_store import RedisResponseStore

        where = f"redis at {redacted(settings.redis_url)}"
        return RedisResponseStore(connect(settings.redis_url), settings.responses_ttl, where)
    folder = cache_root(settings.cache_dir if settings.cache_dir is not None else
                        DEFAULT_CACHE_DIR)
    if folder is None:
        log.info("the cache directory is off: stored responses are kept in memory only")
    return DiskResponseStore(folder, settings.responses_ttl)


def responses_store(request: Request) -> ResponseStore:
    store: ResponseStore = getattr(request.app.state, STATE_ATTR)
    return store
