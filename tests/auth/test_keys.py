"""Keys, their records, durations, headers and the policy's answers, without a server."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import subprocess
import sys

import pytest
from pydantic import ValidationError

from auth.access import AccessDenied
from auth.admin import KeyChanges, NewKey
from auth.factory import AuthConfig, build_access
from auth.headers import format_duration, rate_limit_headers
from auth.keys import KeyDeclaration, KeyOptions, hash_key, mint, parse_duration, parse_instant
from auth.limits import Decision, Limits
from auth.memory_limiter import MemoryLimiter
from auth.policy import KeyAccess
from auth.store import FileKeyStore, MemoryKeyStore, ReadOnlyStore
from tests.auth.conftest import REPO


def test_keys_are_random_prefixed_and_stored_only_as_hashes() -> None:
    secrets_ = {mint(KeyOptions())[0] for _ in range(200)}
    assert len(secrets_) == 200
    secret, record = mint(KeyOptions(name="x"))
    assert secret.startswith("sk-sy-") and len(secret) == len("sk-sy-") + 43  # 256 bits
    assert record.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in record.model_dump_json() and "key_hash" not in record.public()


def test_durations_and_instants() -> None:
    assert parse_duration("90s") == 90 and parse_duration("15m") == 900
    assert parse_duration("1d") == 86400 and parse_duration("1w") == 604800
    assert parse_duration(3600) == 3600 and parse_duration("250ms") == 0.25
    with pytest.raises(ValueError):
        parse_duration("soon")
    assert parse_instant("1970-01-02T00:00:00Z") == 86400
    assert parse_instant("1970-01-02") == 86400  # naive means UTC
    assert parse_instant(5) == 5.0


def test_declarations_validate_the_hash() -> None:
    good = KeyDeclaration(key_sha256="AB" * 32, name="ops", rpm=3)
    record = good.record()
    assert record.key_hash == "ab" * 32 and record.id == "key_" + "ab" * 8 and record.rpm == 3
    with pytest.raises(ValidationError):
        KeyDeclaration(key_sha256="not-a-hash")
    with pytest.raises(ValidationError):
        KeyOptions(rpm=0)


def test_new_key_expiry_and_partial_changes() -> None:
    assert NewKey(expires_in="1h").options(1000.0).expires_at == 4600.0
    changes = KeyChanges.model_validate({"rpm": 5, "models": None})
    assert changes.model_dump(exclude_unset=True) == {"rpm": 5, "models": None}
    with pytest.raises(ValidationError):
        KeyChanges.model_validate({"disabled": None})


def test_duration_format_follows_openai() -> None:
    assert [format_duration(s) for s in (0.02, 1, 1.5, 59.9991, 60, 360, 3723)] == [
        "20ms", "1s", "1.5s", "59.999s", "1m0s", "6m0s", "1h2m3s"]


def test_headers_only_for_limits_the_key_has() -> None:
    decision = Decision(admitted=True, requests_used=2, tokens_used=30, reset_s=12.5)
    assert rate_limit_headers(Limits(), decision) == {}
    both = rate_limit_headers(Limits(rpm=10, tpm=100), decision)
    assert both == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "8",
        "x-ratelimit-reset-requests": "12.5s", "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "70", "x-ratelimit-reset-tokens": "12.5s"}


def test_file_store_is_read_only() -> None:
    store = FileKeyStore([KeyDeclaration(key_sha256="0" * 64).record()])
    with pytest.raises(ReadOnlyStore):
        asyncio.run(store.remove("key_0000000000000000"))


def test_open_mode_only_without_any_auth_setting() -> None:
    assert type(build_access(AuthConfig())).__name__ == "OpenAccess"
    assert isinstance(build_access(AuthConfig(admin_key="x" * 32)), KeyAccess)


async def test_policy_answers() -> None:
    secret, record = mint(KeyOptions(models=["a"], expires_at=2_000.0))
    clock = [1_000.0]
    policy = KeyAccess(MemoryKeyStore([record]), MemoryLimiter(), admin_key="admin",
                       clock=lambda: clock[0])
    principal = await policy.authenticate(secret)
    assert principal.key_id == record.id and not principal.admin
    assert (await policy.authenticate("admin")).admin
    for bad in (None, "", "sk-sy-unknown", secret + "x", "admin "):
        with pytest.raises(AccessDenied) as caught:
            await policy.authenticate(bad)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    with pytest.raises(AccessDenied) as denied:
        await policy.authorize(principal, "b")
    assert denied.value.status_code == 403 and denied.value.code == "model_not_allowed"
    clock[0] = 2_000.0
    with pytest.raises(AccessDenied, match="expired"):
        await policy.authenticate(secret)


def test_a_secret_never_reaches_a_log_call(caplog: pytest.LogCaptureFixture) -> None:
    secret, record = mint(KeyOptions(rpm=1))
    policy = KeyAccess(MemoryKeyStore([record]), MemoryLimiter(), admin_key="adm1n-secret")

    async def cycle() -> None:
        principal = await policy.authenticate(secret)

        async def estimate() -> int:
            return 5

        await policy.admit(principal, "m", estimate)
        with pytest.raises(AccessDenied):
            await policy.admit(principal, "m", estimate)
        with pytest.raises(AccessDenied):
            await policy.authenticate(secret[:-2])

    with caplog.at_level(logging.DEBUG):
        policy.announce()
        asyncio.run(cycle())
    text = caplog.text
    assert secret not in text and secret[:-2] not in text and "adm1n-secret" not in text
    assert hash_key(secret) not in text


def test_nothing_in_auth_imports_torch() -> None:
    code = ("import sys, auth, auth.policy, auth.redis_limiter, auth.redis_store, gateway.guard, "
            "gateway.admin.cli_keys; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
