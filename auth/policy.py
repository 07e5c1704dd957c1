"""KeyAccess: the AccessPolicy with API keys, per-key limits and usage.

Nothing here logs a secret: keys are hashed on arrival and only ids are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping

from auth.access import AccessDenied, Admission, FreeAdmission, Principal, TokenEstimate
from auth.admin import KeyAdmin
from auth.headers import format_duration, rate_limit_headers
from auth.keys import KEY_PREFIX, KeyRecord, hash_key, same_hash
from auth.limits import Consumed, Decision, Limiter, Limits, Ticket
from auth.messages import refusal
from auth.recent_keys import RecentKeys
from auth.store import KeyStore, StoreUnavailable

log = logging.getLogger("switchyard.auth")
SETTLE_RETRIES = 30  # ~5 minutes of retries while Redis is away; then the lease TTL frees it
_WARN_EVERY_S = 10.0


class RateLimited(AccessDenied):
    """A 429 that carries the x-ratelimit-* headers of the refusal."""

    def __init__(self, message: str, *, code: str, retry_after: float | None,
                 headers: Mapping[str, str], limit: str = "") -> None:
        super().__init__(message, status_code=429, code=code, retry_after=retry_after)
        self.headers = dict(headers)
        self.limit = limit  # the limit hit: requests, tokens, parallel, budget, too_large


def unavailable(why: str = "") -> AccessDenied:
    return AccessDenied(
        "The API key and rate limit store (Redis) is unreachable, so this request could not "
        f"be authorized and was not processed{why}. Try again shortly.",
        status_code=503, code="auth_store_unavailable", retry_after=1,
    )


def _invalid(message: str = "Invalid API key. Send a valid key as 'Authorization: Bearer "
             "sk-sy-...'.") -> AccessDenied:
    return AccessDenied(message, status_code=401, code="invalid_api_key")


class KeyAdmission:
    """An admitted request. While it runs, its lease (parallel slot, budget hold) is renewed
    every third of the lease TTL, so only a replica that died lets it expire."""

    def __init__(self, owner: KeyAccess, ticket: Ticket, model: str,
                 headers: Mapping[str, str]) -> None:
        self._owner = owner
        self._ticket = ticket
        self._model = model
        self._headers = headers
        self._settled = False
        self._renewal = owner.keep_alive(ticket)
        # Dropped unsettled (a bug): stop renewing, so the lease lapses after its TTL.
        self._dropped = None if self._renewal is None else \
            weakref.finalize(self, self._renewal.cancel)

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    async def settle(self, used: Consumed) -> None:
        if self._settled:
            return
        self._settled = True
        if self._renewal is not None and self._dropped is not None:
            self._dropped.detach()
            self._renewal.cancel()
        await self._owner.release(self._ticket, self._model, used)


class KeyAccess:
    def __init__(
        self, store: KeyStore, limiter: Limiter, *, admin_key: str | None = None,
        fail_open: bool = False, clock: Callable[[], float] = time.time,
        on_close: Callable[[], Awaitable[None]] | None = None,
        recent: RecentKeys | None = None,
    ) -> None:
        self._store = store
        self._limiter = limiter
        self._admin_hash = hash_key(admin_key) if admin_key else None
        self._fail_open = fail_open
        self._clock = clock
        self._on_close = on_close
        self._admin = KeyAdmin(store, limiter, clock)
        self._pending: set[asyncio.Task[None]] = set()
        self._renewals: set[asyncio.Task[None]] = set()
        self._last_warning = 0.0
        # Failing open trusts only keys validated lately, with their allow-lists.
        self._recent = (recent or RecentKeys()) if fail_open else None

    def announce(self) -> None:
        log.info("API keys required. Keys: %s. Limits and usage: %s.",
                 self._store.describe(), self._limiter.describe())
        if self._admin_hash is None:
            log.warning("No admin key set (--admin-key / SWITCHYARD_ADMIN_KEY): the /admin/keys "
                        "endpoints are disabled.")
        if self._recent is not None:
            log.warning("--auth-fail-open: while Redis is unreachable, keys validated in the "
                        "last %gs are served (with their model allow-lists) WITHOUT checking "
                        "their limits; other keys get 503.", self._recent.ttl_s)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=2.0)
        for task in [*self._pending, *self._renewals]:
            task.cancel()
        await self._limiter.close()
        if self._on_close is not None:
            await self._on_close()

    def key_admin(self) -> KeyAdmin:
        return self._admin

    def is_admin_key(self, api_key: str) -> bool:
        return self._admin_hash is not None and same_hash(hash_key(api_key), self._admin_hash)

    async def authenticate(self, api_key: str | None) -> Principal:
        if not api_key:
            raise _invalid("Missing API key. Send it as 'Authorization: Bearer sk-sy-...'.")
        digest = hash_key(api_key)
        if self._admin_hash is not None and same_hash(digest, self._admin_hash):
            return Principal(key_id=None, admin=True)
        if not api_key.startswith(KEY_PREFIX):
            raise _invalid()
        try:
            record = await self._store.find(digest)
        except StoreUnavailable as exc:
            self._store_down(exc)
            return self._recently_validated(digest, exc)
        try:
            principal = self._check(record, digest)
        except AccessDenied:
            if self._recent is not None:
                self._recent.forget(digest)
            raise
        if self._recent is not None and principal.key is not None:
            self._recent.remember(digest, principal.key)
        return principal

    def _recently_validated(self, digest: str, exc: StoreUnavailable) -> Principal:
        """Failing open: the key as it was last validated, if that was within the TTL."""
        record = self._recent.get(digest) if self._recent is not None else None
        if record is None:
            raise unavailable(", and this gateway has not validated this key lately "
                              "(--auth-fail-open serves only recently validated keys)") from exc
        return self._check(record, digest)

    def _check(self, record: KeyRecord | None, digest: str) -> Principal:
        if record is None or not same_hash(record.key_hash, digest):
            raise _invalid()
        if record.disabled:
            raise _invalid("This API key is disabled.")
        if record.expired(self._clock()):
            raise _invalid("This API key has expired.")
        return Principal(key_id=record.id, key=record)

    async def authorize(self, principal: Principal, model: str) -> None:
        # 403, not 404: the caller is known and the model exists; this key lacks the right.
        if not principal.may_use(model):
            raise AccessDenied(f"This API key is not allowed to use the model `{model}`.",
                               status_code=403, code="model_not_allowed")

    async def admit(self, principal: Principal, model: str, estimate: TokenEstimate) -> Admission:
        await self.authorize(principal, model)
        key = principal.key
        if key is None:  # the admin key
            return FreeAdmission()
        limits = Limits.of(key)
        try:
            reserve = 0
            if limits.counts_tokens:
                # A key already over a limit is refused before its prompt is counted.
                early = await self._limiter.check(key.id, limits)
                if not early.admitted:
                    raise self._refused(limits, early, None, rate_limit_headers(limits, early))
                reserve = await estimate()
            decision, ticket = await self._limiter.acquire(key.id, limits, reserve)
        except StoreUnavailable as exc:
            self._store_down(exc)  # failing open: a recently validated key, its limits unchecked
            return FreeAdmission()
        headers = rate_limit_headers(limits, decision)
        if not decision.admitted:
            raise self._refused(limits, decision, reserve, headers)
        return KeyAdmission(self, ticket, model, headers)

    def keep_alive(self, ticket: Ticket) -> asyncio.Task[None] | None:
        """Renew the ticket's lease every third of its TTL until cancelled (at settlement)."""
        if not (ticket.limits.parallel or ticket.limits.budget):
            return None
        task = asyncio.get_running_loop().create_task(self._renew_every(ticket))
        self._renewals.add(task)
        task.add_done_callback(self._renewals.discard)
        return task

    async def _renew_every(self, ticket: Ticket) -> None:
        interval = self._limiter.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await self._limiter.renew(ticket)
            except StoreUnavailable:
                log.debug("renewing a lease of key %s failed: Redis unreachable", ticket.key_id)
            except Exception:
                log.exception("renewing a lease of key %s failed", ticket.key_id)

    def _refused(self, limits: Limits, decision: Decision, reserve: int | None,
                 headers: Mapping[str, str]) -> RateLimited:
        retry = decision.retry_after_s
        message, code, final = refusal(limits, decision, reserve)
        if retry is not None and not final:
            message += f" Retry in {format_duration(retry)}."
        extra = {"x-should-retry": "false"} if final else {}
        return RateLimited(message, code=code, retry_after=None if final else retry,
                           headers={**headers, **extra}, limit=decision.reason)

    def _store_down(self, exc: StoreUnavailable) -> None:
        """Fail open (log, go on) or closed (503). Warnings at most every few seconds."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            mode = ("serving recently validated keys WITHOUT limits (--auth-fail-open)"
                    if self._fail_open else "answering 503")
            log.warning("auth store unreachable (%s); %s until it returns", exc, mode)
        if not self._fail_open:
            raise unavailable() from exc

    async def release(self, ticket: Ticket, model: str, used: Consumed) -> None:
        try:
            await self._limiter.release(ticket, model, used)
        except StoreUnavailable:
            self._release_later(ticket, model, used)
        except Exception:
            log.exception("settling a request of key %s failed", ticket.key_id)

    def _release_later(self, ticket: Ticket, model: str, used: Consumed) -> None:
        async def retry() -> None:
            for attempt in range(SETTLE_RETRIES):
                await asyncio.sleep(min(0.5 * 2**attempt, 10.0))
                with contextlib.suppress(StoreUnavailable):
                    await self._limiter.release(ticket, model, used)
                    return
            log.warning("gave up settling a request of key %s; its lease expires by itself",
                        ticket.key_id)

        task = asyncio.get_running_loop().create_task(retry())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
