"""`switchyard keys create | list | revoke | usage` (`switchyard serve`'s auth flags are in
gateway/flag_table.py).

A command talks to a running gateway's /admin/keys with the admin key (`--url`,
default http://127.0.0.1:8080), or straight to Redis with `--redis-url`.
`keys create --offline` needs neither: it prints a key and the hashed entry to
paste into the config file's `keys:` list.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any, Protocol

import httpx
import yaml
from pydantic import ValidationError

from auth.admin import KeyAdmin, KeyNotFound, NewKey
from auth.keys import mint
from gateway.settings import Settings

_LIMITS = (("--rpm", "requests per minute"), ("--tpm", "tokens per minute (prompt + completion)"),
           ("--parallel", "requests at a time"), ("--budget", "tokens in all, or per period"))


def add_keys_command(commands: Any) -> None:
    target = argparse.ArgumentParser(add_help=False)
    target.add_argument("--url", default="http://127.0.0.1:8080",
                        help="the gateway (default http://127.0.0.1:8080)")
    target.add_argument("--admin-key", dest="admin_key", default=argparse.SUPPRESS,
                        help="the admin key (default: $SWITCHYARD_ADMIN_KEY)")
    target.add_argument("--redis-url", dest="redis_url", default=argparse.SUPPRESS,
                        help="work on Redis directly instead of through a gateway")
    keys = commands.add_parser("keys", help="create, list and revoke API keys; read usage")
    sub = keys.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", parents=[target], help="create a key (shown once)")
    create.add_argument("--name", default="", help="a label for people")
    create.add_argument("--models", help="comma-separated served names (default: all)")
    for flag, help_text in _LIMITS:
        create.add_argument(flag, type=int, help=help_text)
    create.add_argument("--budget-period", help="budget renews every: 1d, 30d, 12h, 3600")
    create.add_argument("--expires-in", help="expiry from now: 90s, 12h, 30d")
    create.add_argument("--expires-at", help="expiry as an ISO 8601 date/time (UTC if naive)")
    create.add_argument("--offline", action="store_true",
                        help="print a key and its config-file entry; change nothing")
    sub.add_parser("list", parents=[target], help="list keys (never their secrets)")
    for name, help_text in (("revoke", "revoke a key at once"), ("usage", "a key's usage")):
        sub.add_parser(name, parents=[target], help=help_text).add_argument("key_id")


class _Target(Protocol):
    async def create(self, spec: NewKey) -> dict[str, Any]: ...
    async def list(self) -> dict[str, Any]: ...
    async def revoke(self, key_id: str) -> dict[str, Any]: ...
    async def usage(self, key_id: str) -> dict[str, Any]: ...


class _Failed(Exception):
    pass


class _Gateway:
    def __init__(self, url: str, admin_key: str | None) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=30)

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            async with self._client as client:
                response = await client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise _Failed(f"cannot reach the gateway at {self._client.base_url}: {exc}") from None
        data = response.json() if response.content else {}
        if response.status_code >= 400:
            message = data.get("error", {}).get("message") if isinstance(data, dict) else None
            raise _Failed(f"HTTP {response.status_code}: {message or response.text}")
        return data

    async def create(self, spec: NewKey) -> dict[str, Any]:
        return await self._call("POST", "/admin/keys", spec.model_dump(exclude_unset=True))

    async def list(self) -> dict[str, Any]:
        return await self._call("GET", "/admin/keys")

    async def revoke(self, key_id: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/admin/keys/{key_id}")

    async def usage(self, key_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/admin/keys/{key_id}/usage")


class _Redis:
    def __init__(self, url: str) -> None:
        self._url = url

    async def _run(self, work: Any) -> dict[str, Any]:
        from auth.redis_conn import connect
        from auth.redis_limiter import RedisLimiter
        from auth.redis_store import RedisKeyStore
        from auth.store import StoreUnavailable

        redis = connect(self._url)
        try:
            return await work(KeyAdmin(RedisKeyStore(redis), RedisLimiter(redis)))
        except StoreUnavailable as exc:
            raise _Failed(str(exc)) from None
        except KeyNotFound as exc:
            raise _Failed(exc.message) from None
        finally:
            await redis.aclose()

    async def create(self, spec: NewKey) -> dict[str, Any]:
        async def work(admin: KeyAdmin) -> dict[str, Any]:
            secret, record = await admin.create(spec)
            return {**record.public(), "key": secret}
        return await self._run(work)

    async def list(self) -> dict[str, Any]:
        async def work(admin: KeyAdmin) -> dict[str, Any]:
            return {"object": "list", "data": [r.public() for r in await admin.list()]}
        return await self._run(work)

    async def revoke(self, key_id: str) -> dict[str, Any]:
        async def work(admin: KeyAdmin) -> dict[str, Any]:
            await admin.revoke(key_id)
            return {"id": key_id, "object": "api_key", "deleted": True}
        return await self._run(work)

    async def usage(self, key_id: str) -> dict[str, Any]:
        async def work(admin: KeyAdmin) -> dict[str, Any]:
            return await admin.usage(await admin.get(key_id))
        return await self._run(work)


def _new_key(args: argparse.Namespace) -> NewKey:
    fields = {"rpm": args.rpm, "tpm": args.tpm, "parallel": args.parallel, "budget": args.budget,
              "budget_period": args.budget_period, "expires_in": args.expires_in,
              "expires_at": args.expires_at}
    values: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
    if args.models:
        values["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    return NewKey(name=args.name, **values)


def _offline(spec: NewKey) -> str:
    options = spec.options(time.time())
    secret, record = mint(options)
    entry = {"name": record.name, "id": record.id, "key_sha256": record.key_hash,
             **options.model_dump(exclude={"name"}, exclude_defaults=True)}
    if options.expires_at is not None:
        moment = datetime.fromtimestamp(options.expires_at, UTC)
        entry["expires_at"] = moment.isoformat(timespec="seconds")
    snippet = yaml.safe_dump([entry], sort_keys=False)
    return (f"API key (shown once; store it now): {secret}\n"
            f"Add to the config file's `keys:` list:\n{snippet}")


def _target(args: argparse.Namespace) -> _Target:
    given = {k: getattr(args, k) for k in ("admin_key", "redis_url") if hasattr(args, k)}
    settings = Settings(**given)  # the flags, else SWITCHYARD_ADMIN_KEY / SWITCHYARD_REDIS_URL
    if settings.redis_url:
        return _Redis(settings.redis_url)
    admin = settings.admin_key.get_secret_value() if settings.admin_key else None
    return _Gateway(args.url, admin)


async def _dispatch(target: _Target, args: argparse.Namespace) -> dict[str, Any]:
    command = args.keys_command
    if command == "create":
        return await target.create(_new_key(args))
    if command == "list":
        return await target.list()
    if command == "revoke":
        return await target.revoke(args.key_id)
    return await target.usage(args.key_id)


def run_keys(args: argparse.Namespace) -> int:
    try:
        if args.keys_command == "create" and args.offline:
            print(_offline(_new_key(args)), end="")
            return 0
        result = asyncio.run(_dispatch(_target(args), args))
    except (_Failed, ValidationError, ValueError) as exc:
        print(f"switchyard keys: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    if args.keys_command == "create":
        print("Store this key now: it is not shown again.", file=sys.stderr)
    return 0
