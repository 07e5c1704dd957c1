"""The access policy the settings ask for.

Keys come from the config file when it declares any, else from Redis when a URL
is set, else from memory (created through /admin/keys). Limits and usage live in
Redis when a URL is set (shared by replicas), else in this process. With no admin
key, no Redis and no declared keys, the gateway runs open.
"""

from __future__ import annotations

from dataclasses import dataclass

from auth.access import AccessPolicy, OpenAccess
from auth.admin_key import check_admin_key
from auth.keys import KeyDeclaration
from auth.limits import LEASE_TTL_S, WINDOW_S, Limiter
from auth.memory_limiter import MemoryLimiter
from auth.policy import KeyAccess
from auth.recent_keys import FAIL_OPEN_TTL_S, RecentKeys
from auth.store import FileKeyStore, KeyStore, MemoryKeyStore


@dataclass(frozen=True)
class AuthConfig:
    admin_key: str | None = None
    redis_url: str | None = None
    fail_open: bool = False
    keys: tuple[KeyDeclaration, ...] = ()
    lease_ttl_s: float = LEASE_TTL_S
    window_s: float = WINDOW_S
    fail_open_ttl_s: float = FAIL_OPEN_TTL_S  # how recent a validation failing open trusts

    @property
    def enabled(self) -> bool:
        return bool(self.admin_key or self.redis_url or self.keys)


def build_access(config: AuthConfig) -> AccessPolicy:
    if not config.enabled:
        return OpenAccess()
    if config.admin_key is not None:
        check_admin_key(config.admin_key)  # a weak or placeholder key stops the server here
    if config.redis_url is None:
        store = _declared(config) or MemoryKeyStore()
        limiter = MemoryLimiter(window_s=config.window_s, lease_ttl_s=config.lease_ttl_s)
        return KeyAccess(store, limiter, admin_key=config.admin_key, fail_open=config.fail_open,
                         recent=RecentKeys(config.fail_open_ttl_s))
    from auth.redis_conn import connect, redacted
    from auth.redis_limiter import RedisLimiter
    from auth.redis_store import RedisKeyStore

    redis = connect(config.redis_url)
    where = f"redis at {redacted(config.redis_url)}"
    store = _declared(config) or RedisKeyStore(redis, where)
    limiter: Limiter = RedisLimiter(redis, config.window_s, config.lease_ttl_s, where)
    return KeyAccess(store, limiter, admin_key=config.admin_key, fail_open=config.fail_open,
                     on_close=redis.aclose, recent=RecentKeys(config.fail_open_ttl_s))


def _declared(config: AuthConfig) -> KeyStore | None:
    if not config.keys:
        return None
    return FileKeyStore(d.record() for d in config.keys)
