"""Added latency of API keys + limits per request, Redis on loopback, against auth off.

Starts a redis-server on a free port and two gateway processes serving a null backend
(one event, no model: what is left is the gateway's own work): one in open mode, one
with keys and limits in that Redis. One client sends sequential non-streamed chat
requests, round-robin over the arms, so drift hits every arm alike:

- `off`: open mode, no key checked;
- `key`: a key without limits (hashed lookup in Redis, usage recorded at the end);
- `limits`: a key with RPM, TPM, a parallel cap and a budget, none of them reached (the
  admission and settlement Lua scripts, plus counting the prompt's tokens).

It prints p50/p99 per arm and what each auth arm adds over `off`, then the policy alone
(authenticate + admit + settle, in process, same Redis). Target: < 1 ms added at p50.

    .venv/bin/python -m bench.auth_latency [--requests 2000] [--warmup 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import facts_line, machine_facts, write_json
from bench.gateway_process import InstantBackend, percentiles, serve_app, wait_for_gateway

ADMIN_KEY = "bench-admin-key-" + "0123456789abcdef" * 2  # the server wants 32+ characters
BODY = {"model": "null", "messages": [{"role": "user", "content": "one two three four"}],
        "max_tokens": 1}
LIMITS = {"rpm": 10_000_000, "tpm": 1_000_000_000, "parallel": 1000, "budget": 10**15}


def serve(port_file: str, redis_url: str | None) -> None:
    from gateway.app import create_app
    from gateway.settings import Settings

    settings = Settings(model_id="null", redis_url=redis_url,
                        admin_key=ADMIN_KEY if redis_url else None, log_level="warning")
    app = create_app(settings, backends={"null": InstantBackend("null", tokens=1)})
    serve_app(app, port_file)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found (scripts/setup.sh installs it)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_gateway(folder: Path, name: str, redis_url: str | None) -> tuple[subprocess.Popen, str]:
    port_file = folder / f"{name}.port"
    argv = [sys.executable, "-m", "bench.auth_latency", "--serve", str(port_file)]
    if redis_url:
        argv += ["--redis-url", redis_url]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env)
    return proc, wait_for_gateway(port_file, name)


def measure(arms: dict[str, tuple[str, str | None]], requests: int, warmup: int,
            ) -> dict[str, list[float]]:
    clients = {name: httpx.Client(base_url=url, timeout=10,
                                  headers={"Authorization": f"Bearer {key or 'none'}"})
               for name, (url, key) in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for i in range(warmup + requests):
            for name, client in clients.items():
                began = time.perf_counter()
                response = client.post("/v1/chat/completions", json=BODY)
                elapsed = time.perf_counter() - began
                if response.status_code != 200:
                    raise SystemExit(f"{name}: HTTP {response.status_code}: {response.text}")
                if i >= warmup:
                    times[name].append(elapsed)
    finally:
        for client in clients.values():
            client.close()
    return times


async def policy_alone(redis_url: str, secret: str, requests: int) -> list[float]:
    """authenticate + admit + settle against the same Redis, without HTTP."""
    from auth.factory import AuthConfig, build_access
    from auth.limits import Consumed

    policy = build_access(AuthConfig(redis_url=redis_url))

    async def estimate() -> int:
        return 5

    times = []
    for i in range(requests + 100):
        began = time.perf_counter()
        principal = await policy.authenticate(secret)
        admission = await policy.admit(principal, "null", estimate)
        await admission.settle(Consumed(4, 1, True))
        if i >= 100:
            times.append(time.perf_counter() - began)
    await policy.close()
    return times


def create_key(url: str, **limits: int) -> str:
    response = httpx.post(f"{url}/admin/keys", json={"name": "bench", **limits},
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    response.raise_for_status()
    return response.json()["key"]


def report(times: dict[str, list[float]], alone: list[float], requests: int) -> None:
    print(f"\nauth latency: {requests} sequential non-streamed chat requests per arm, "
          f"round-robin, loopback, null backend\n")
    print(f"{'arm':<44}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>10}{'+p99 ms':>10}")
    base50, base99 = percentiles(times["off"])
    labels = {"off": "auth off (open mode)", "key": "key, no limits (lookup + usage)",
              "limits": "key + RPM/TPM/parallel/budget (Lua x2)"}
    for name, samples in times.items():
        p50, p99 = percentiles(samples)
        extra = "" if name == "off" else f"{p50 - base50:>+10.3f}{p99 - base99:>+10.3f}"
        print(f"{labels[name]:<44}{p50:>9.3f}{p99:>9.3f}{extra}")
    p50, p99 = percentiles(alone)
    print(f"\npolicy alone (authenticate + admit + settle, limits key): "
          f"p50 {p50:.3f} ms, p99 {p99:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write figures + machine facts here")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.redis_url)
        return
    facts = machine_facts(None, threads=1)  # no model; each gateway runs OMP_NUM_THREADS=1
    print(facts_line(facts))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        redis, redis_url = start_redis(folder)
        procs = [redis]
        try:
            off, off_url = start_gateway(folder, "off", None)
            procs.append(off)
            on, on_url = start_gateway(folder, "on", redis_url)
            procs.append(on)
            arms = {"off": (off_url, None), "key": (on_url, create_key(on_url)),
                    "limits": (on_url, create_key(on_url, **LIMITS))}
            times = measure(arms, args.requests, args.warmup)
            alone = asyncio.run(policy_alone(redis_url, arms["limits"][1] or "", args.requests))
            report(times, alone, args.requests)
            write_json(args.json, facts, {
                name: dict(zip(("p50_ms", "p99_ms"), percentiles(samples), strict=True))
                for name, samples in {**times, "policy_alone": alone}.items()})
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
