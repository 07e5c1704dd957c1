"""docker-compose.yml is secure by default: Redis requires a password (its one user is the
gateways'; tests/deploy/test_redis_acl.py checks what that user may do), images are pinned.

Redis's command is taken from `docker-compose config` and run as a real redis-server (only
port, bind address and data folder set locally): an unauthenticated SET is refused, the
gateways' SWITCHYARD_REDIS_URL gets in, and the healthcheck passes only with the password.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from tests.auth.password_redis import PasswordRedis
from tests.deploy.compose import COMPOSE, COMPOSE_CUDA, SECRETS, compose, compose_services
from tests.deploy.envoy_proxy import upstream_names

PINNED = re.compile(r"^[\w./-]+(:v?\d+\.\d+\.\d+[\w.-]*|@sha256:[0-9a-f]{64})$")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return compose_services()


@pytest.fixture(scope="module")
def compose_redis(services: dict[str, Any],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordRedis]:
    user = urlsplit(services["gateway-1"]["environment"]["SWITCHYARD_REDIS_URL"]).username
    server = PasswordRedis(tmp_path_factory.mktemp("compose-redis"),
                           services["redis"]["command"], SECRETS["REDIS_PASSWORD"], user)
    server.start()
    yield server
    server.stop()


def test_compose_requires_a_redis_password() -> None:
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_PASSWORD"},
           "SWITCHYARD_ADMIN_KEY": SECRETS["SWITCHYARD_ADMIN_KEY"]}
    result = compose("config", env=env)
    assert result.returncode != 0 and "REDIS_PASSWORD" in result.stderr, result.stderr
    result = compose("config", env={**env, "REDIS_PASSWORD": ""})  # empty counts as unset
    assert result.returncode != 0 and "REDIS_PASSWORD" in result.stderr, result.stderr


def test_the_compose_redis_refuses_an_unauthenticated_set(compose_redis: PasswordRedis) -> None:
    forged = ("SET", "sy:key:" + "0" * 64, '{"id": "key_forged"}')
    (refused,) = compose_redis.send(forged)
    assert refused.startswith(b"-NOAUTH"), refused
    assert compose_redis.send(("DEL", "sy:budget:x"))[0].startswith(b"-NOAUTH")
    assert compose_redis.send(("AUTH", "guess"), forged)[1].startswith(b"-NOAUTH")
    # the default user is off, even with the password
    assert compose_redis.send(("AUTH", SECRETS["REDIS_PASSWORD"]), forged)[1].startswith(
        b"-NOAUTH")
    assert compose_redis.send(("AUTH", "switchyard", SECRETS["REDIS_PASSWORD"]), forged) == [
        b"+OK", b"+OK"]


def test_the_gateways_redis_url_authenticates(services: dict[str, Any],
                                              compose_redis: PasswordRedis) -> None:
    for name in upstream_names():
        url = services[name]["environment"]["SWITCHYARD_REDIS_URL"]
        local = url.replace("@redis:6379/", f"@127.0.0.1:{compose_redis.port}/")
        assert local != url, url  # the service name and port, with the password before them
        with redis.Redis.from_url(local) as client:
            assert client.set(f"sy:probe:{name}", "1")


def test_the_redis_healthcheck_needs_the_password(services: dict[str, Any],
                                                  compose_redis: PasswordRedis) -> None:
    check = services["redis"]["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL", check
    script = check[1].replace("redis-cli", f"redis-cli -p {compose_redis.port}")
    base = {"PATH": os.environ["PATH"]}
    with_password = {**base, **services["redis"]["environment"]}
    assert subprocess.run(["sh", "-c", script], env=with_password, timeout=10).returncode == 0
    # a bare `redis-cli ping` exits 0 on NOAUTH: without the password the check must fail
    assert subprocess.run(["sh", "-c", script], env=base, timeout=10,
                          capture_output=True).returncode != 0


def test_redis_publishes_no_port(services: dict[str, Any]) -> None:
    assert "ports" not in services["redis"]
    assert "network_mode" not in services["redis"]


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_CUDA)])
def test_compose_images_are_pinned(files: tuple[Path, ...]) -> None:
    for name, service in compose_services(files=files).items():
        assert PINNED.match(service["image"]), (name, service["image"])
