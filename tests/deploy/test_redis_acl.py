"""The gateway's own Redis user, as docker-compose.yml and deploy/k8s ship it: a real
redis-server run with the shipped command (only port, bind address and data folder set
here), reached with the gateway's own SWITCHYARD_REDIS_URL.

Through that user every operation of the auth store works: the key store's (create, find,
list, update, revoke) and every scenario of tests/auth/test_limiter.py (admit, settle, renew,
budgets, usage, leases that lapse). What the gateway never does is refused: FLUSHALL, CONFIG,
KEYS, ACL, pub/sub, a key outside `sy:`, a script that tries any of those; the default user
is off. Every command auth/lua.py's scripts call is one the user may run, so a script branch
no scenario reaches cannot fail in production on a missing permission.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from auth.admin import KeyAdmin, KeyChanges, NewKey
from auth.keys import hash_key
from auth.redis_conn import connect
from auth.redis_limiter import RedisLimiter
from auth.redis_store import RedisKeyStore
from tests.auth import test_limiter as limiter_suite
from tests.auth.password_redis import PasswordRedis
from tests.deploy.compose import SECRETS, compose_services
from tests.deploy.k8s_objects import Doc, environment, expanded_args, kustomized, user_secrets

REPO = Path(__file__).resolve().parents[2]
LUA_CALL = re.compile(r"redis\.call\('(\w+)'")


@dataclass(frozen=True)
class Shipped:
    """A Redis as shipped, and the gateway's URL pointed at it."""

    server: PasswordRedis
    url: str
    command: list[str]


def _compose() -> tuple[list[str], str, str]:
    services = compose_services()
    url = services["gateway-1"]["environment"]["SWITCHYARD_REDIS_URL"]
    return services["redis"]["command"], url, SECRETS["REDIS_PASSWORD"]


def _k8s() -> tuple[list[str], str, str]:
    objects = {(d["kind"], d["metadata"]["name"]): d for d in kustomized()}
    config_maps = {name: d["data"] for (kind, name), d in objects.items() if kind == "ConfigMap"}
    made = user_secrets()

    def container(kind: str, name: str) -> Doc:
        (only,) = objects[(kind, name)]["spec"]["template"]["spec"]["containers"]
        return only

    redis_container = container("StatefulSet", "switchyard-redis")
    args = expanded_args(redis_container, environment(redis_container, config_maps, made))
    gateway_env = environment(container("Deployment", "switchyard"), config_maps, made)
    return args, gateway_env["SWITCHYARD_REDIS_URL"], made["switchyard-redis"][
        "REDIS_PASSWORD"]


SOURCES: dict[str, Callable[[], tuple[list[str], str, str]]] = {"compose": _compose,
                                                                "k8s": _k8s}


@pytest.fixture(scope="module", params=list(SOURCES))
def shipped(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shipped]:
    command, url, password = SOURCES[request.param]()
    user = urlsplit(url).username
    assert user and user != "default", url  # the gateway has a user of its own
    server = PasswordRedis(tmp_path_factory.mktemp(f"{request.param}-acl"), command, password,
                           user)
    server.start()
    local = re.sub(r"@[\w.-]+:\d+/", f"@127.0.0.1:{server.port}/", url)
    assert local != url, url
    yield Shipped(server, local, list(command))
    server.stop()


def _limiter_scenarios() -> list[Callable[..., object]]:
    return [f for name, f in vars(limiter_suite).items()
            if name.startswith("test_") and inspect.iscoroutinefunction(f)]


@dataclass(frozen=True)
class _At:
    url: str  # what the Redis-only scenarios read of their `redis_server`


@pytest.mark.parametrize("scenario", _limiter_scenarios(), ids=lambda f: f.__name__)
async def test_every_limiter_scenario_runs_as_the_gateway_user(
    shipped: Shipped, scenario: Callable[..., object],
) -> None:
    parameters = inspect.signature(scenario).parameters
    if "subject" not in parameters:  # the Redis-only ones
        await scenario(_At(shipped.url))  # type: ignore[misc]
        return
    client = connect(shipped.url)
    try:
        limiter = RedisLimiter(client, limiter_suite.WINDOW_S, limiter_suite.LEASE_S)
        key = "key_" + secrets.token_hex(6)
        await scenario(limiter_suite.Subject(limiter, asyncio.sleep, key))  # type: ignore[misc]
    finally:
        await client.aclose()


async def test_the_key_store_works_as_the_gateway_user(shipped: Shipped) -> None:
    client = connect(shipped.url)
    try:
        store = RedisKeyStore(client)
        admin = KeyAdmin(store, RedisLimiter(client))
        secret, record = await admin.create(NewKey(name="acl", rpm=5, budget=100))
        assert (await store.find(hash_key(secret))) == record
        assert record in await admin.list()
        updated = await admin.update(record.id, KeyChanges(name="renamed"))
        assert (await admin.get(record.id)).name == updated.name == "renamed"
        usage = await admin.usage(updated)
        assert usage["budget"]["used"] == 0
        await admin.revoke(record.id)
        assert await store.find(hash_key(secret)) is None
    finally:
        await client.aclose()


def _refused(client: redis.Redis, *command: str) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command(*command)


def test_what_the_gateway_never_does_is_refused(shipped: Shipped) -> None:
    with redis.Redis.from_url(shipped.url, decode_responses=True) as client:
        client.set("sy:acl:kept", "1")
        for command in (("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"),
                        ("CONFIG", "SET", "dir", "/tmp"), ("KEYS", "*"), ("SCAN", "0"),
                        ("ACL", "LIST"), ("ACL", "SETUSER", "x", "on", "+@all"),
                        ("SUBSCRIBE", "c"), ("PUBLISH", "c", "m"), ("SHUTDOWN",),
                        ("MODULE", "LIST"), ("EVAL", "return 1", "0"),
                        ("GET", "other"), ("SET", "other", "1"), ("DEL", "not-sy:key")):
            _refused(client, *command)
        # A script runs as its caller: it reaches no more than the user does.
        for body, keys in (("return redis.call('FLUSHALL')", ()),
                           ("return redis.call('SET', 'other', '1')", ()),
                           ("return redis.call('SET', KEYS[1], '1')", ("other",))):
            sha = client.script_load(body)
            with pytest.raises(redis.exceptions.ResponseError,
                               match=r"(?i)no ?perm|can't (run|access)"):
                client.evalsha(sha, len(keys), *keys)
        assert client.get("sy:acl:kept") == "1"
    with redis.Redis(port=shipped.server.port, password=shipped.server.password) as default:
        with pytest.raises(redis.exceptions.AuthenticationError):
            default.ping()  # the default user is off, whatever its password


def test_every_command_the_lua_scripts_call_is_allowed(shipped: Shipped) -> None:
    allowed = {arg[1:].lower() for arg in shipped.command if re.fullmatch(r"\+[\w|]+", arg)}
    called = {name.lower() for name in LUA_CALL.findall((REPO / "auth" / "lua.py").read_text())}
    assert called and called <= allowed, called - allowed
