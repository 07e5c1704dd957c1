"""A Redis password reaches Redis and never a log line.

A real redis-server with `--requirepass`; a real gateway (uvicorn) whose Redis URL carries
the password, in either form redis-py reads: `redis://:<password>@host` or
`redis://host?password=<password>`. Keys made through it prove the password is used; every
log record of startup, traffic and shutdown is searched for it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator

import httpx
import pytest

from auth.redis_conn import redacted
from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, admin_headers
from tests.auth.password_redis import PasswordRedis
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

PASSWORD = "pw-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordRedis]:
    server = PasswordRedis(tmp_path_factory.mktemp("redis"),
                           ["redis-server", "--requirepass", PASSWORD], PASSWORD)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_the_redis_password_is_used_and_never_logged(
    secured: PasswordRedis, form: str, caplog: pytest.LogCaptureFixture,
) -> None:
    url = (f"redis://:{PASSWORD}@127.0.0.1:{secured.port}/0" if form == "userinfo"
           else f"redis://127.0.0.1:{secured.port}/0?password={PASSWORD}")
    caplog.set_level(logging.DEBUG)
    app = create_app(Settings(admin_key=ADMIN_KEY, redis_url=url),
                     backends={"echo": EchoBackend()})
    with running_server(app) as base:
        made = httpx.post(f"{base}/admin/keys", json={"name": form}, headers=admin_headers(),
                          timeout=10)
        assert made.status_code == 201, made.text  # the gateway authenticated to Redis
        key = made.json()["key"]
        chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=10,
                          headers={"Authorization": f"Bearer {key}"}).status_code == 200
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert f"redis at {redacted(url)}" in logged  # the startup line names where keys live
    assert PASSWORD not in logged
    assert PASSWORD[3:20] not in logged  # no piece of it either


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@redis:6379/0", "redis://***@redis:6379/0"),
    ("redis://gateway:s3cret@redis:6379/0", "redis://***@redis:6379/0"),
    ("rediss://s3cret@redis/0", "rediss://***@redis/0"),  # a lone token in the user's place
    ("redis://redis:6379/0?password=s3cret&db=1", "redis://redis:6379/0?password=***&db=1"),
    ("redis://redis/0?db=1&PassWord=s3cret", "redis://redis/0?db=1&PassWord=***"),
    ("redis://redis/0?%70assword=s3cret", "redis://redis/0?%70assword=***"),
    ("redis://:p%40ss@redis:6379/0", "redis://***@redis:6379/0"),
    ("redis://redis:6379/0", "redis://redis:6379/0"),
])
def test_every_form_of_secret_in_a_redis_url_is_redacted(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_the_secured_redis_refuses_a_client_without_the_password(
        secured: PasswordRedis) -> None:
    forged = ("SET", "sy:key:forged", "{}")
    (refused,) = secured.send(forged)
    assert refused.startswith(b"-NOAUTH"), refused
    assert secured.send(("AUTH", PASSWORD), forged) == [b"+OK", b"+OK"]
