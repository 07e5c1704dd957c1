"""Soak: a real server under mixed traffic at ~2x its capacity for a long while (not in CI).

    .venv/bin/python -m bench.soak                 # 20 minutes, a tiny random Llama
    .venv/bin/python -m bench.soak --minutes 3 --json soak.json
    .venv/bin/python -m bench.soak --model default

It starts redis-server (append-only file, fsync always) on a free port, then
`python -m gateway.cli serve` with API keys on, creates two keys through the admin API, and
drives chat / completions / TGI /generate and /generate_stream traffic from 2x --batch-size
concurrent clients (the server takes --batch-size sequences per step and 1.5x that in
flight): 30% of streams are left midway, ~8% of requests are bad bodies. Redis is killed
(SIGKILL) and restarted once, midway. The first part of the run is warm-up, after which the
server's RSS is read while it idles.

Checks (exit 1 when one fails): every request got its answer or a clear 4xx / 429 / 503 (503
only while Redis is away; no other 5xx, no stream error, nothing past --request-timeout-s);
afterwards the KV cache is back to no block in use and nothing runs or waits; the server's
RSS is within 10% of its level after warm-up; the usage in Redis matches what was served.

What "served" means: a request read to its end was served the completion tokens its usage
reports, and those are what the gateway bills, exactly (the `kept` key's usage must equal
their sum). A stream the client left midway is billed what the engine generated before the
gateway saw the client go: at least the tokens the client read, at most its max_tokens; those
streams use their own key (`cut`), whose usage is checked against those two bounds. Their
prompts are billed too (as is the prompt of a stream left before its first token, while it
was prefilled: none here, as a cut stream reads at least one token), but the bounds are on
completion tokens, which a client can count; a prompt billed adds none. The
server's own counter (switchyard_generated_tokens_total, generations that finished) must lie
between the kept key's tokens and both keys' usage together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.soak_traffic import Tally, one

MODEL = "soak-model"
ADMIN_KEY = "sy-admin-soak-" + os.urandom(16).hex()  # 32+ characters, or the server refuses it
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Redis:
    """redis-server with an fsync-always append-only file, so a SIGKILL loses nothing."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (scripts/setup.sh installs it)")
        self.argv = [binary, "--port", str(free_port()), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "yes", "--appendfsync", "always", "--dir", str(folder)]
        self.url = f"redis://127.0.0.1:{self.argv[2]}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not self._pong():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", int(self.argv[2])), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


class Server:
    """`python -m gateway.cli serve` in a child process, its log in a file."""

    def __init__(self, model: str, redis_url: str, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            sys.executable, "-m", "gateway.cli", "serve", "--model-id", model,
            "--served-model-name", MODEL, "--port", str(self.port), "--redis-url", redis_url,
            "--max-batch-size", str(args.batch_size),
            "--max-concurrent-requests", str(args.batch_size * 3 // 2),
            "--max-total-tokens", "512", "--max-batch-total-tokens", str(args.kv_tokens),
            "--log-level", "warning", *args.server_args.split(),
        ]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 900) -> None:
        env = {**os.environ, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the server did not become healthy; see {self.log}")

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def metric(text: str, name: str) -> float:
    """The value of the soak model's series `name` in a /metrics text."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def create_keys(url: str) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    keys = {}
    for name in ("kept", "cut"):
        answer = httpx.post(f"{url}/admin/keys", headers=headers, timeout=10,
                            json={"name": f"soak-{name}", "parallel": 100_000})
        answer.raise_for_status()
        keys[name] = answer.json()["key"]
    return keys


def usage(url: str, key: str) -> dict[str, int]:
    answer = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    answer.raise_for_status()
    rows = [r for r in answer.json()["data"] if r["model"] == MODEL]
    return {"requests": sum(r["requests"] for r in rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows)}


async def drive(url: str, keys: dict[str, str], seconds: float, args: argparse.Namespace,
                tally: Tally, seed: int) -> None:
    """`args.concurrency` clients, each sending one request after another until time is up."""
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=args.concurrency * 2)

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            result = await one(http, MODEL, rng, keys, args.cut_share, args.bad_share,
                               args.request_timeout_s)
            tally.results.append(result)
            if result.outcome in ("overloaded", "unavailable"):  # as a client would: back off
                await asyncio.sleep(rng.uniform(0.2, 1.0))

    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout_s,
                                 limits=limits) as http:
        await asyncio.gather(*(client(i) for i in range(args.concurrency)))


async def redis_outage(redis: Redis, after_s: float, down_s: float,
                       window: list[float]) -> None:
    await asyncio.sleep(after_s)
    window.append(time.monotonic())
    redis.kill()
    await asyncio.sleep(down_s)
    await asyncio.to_thread(redis.start)
    window.append(time.monotonic())


def wait_idle(url: str, timeout_s: float = 60) -> dict[str, float]:
    """The KV blocks in use, running and queued requests, once all three are 0 (or at the
    timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(url)
        state = {name: metric(text, name) for name in (
            "switchyard_kv_blocks_used", "switchyard_running_requests", "switchyard_queue_size")}
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def settled_usage(url: str, keys: dict[str, str], before: dict[str, dict[str, int]],
                  served: int, timeout_s: float = 90) -> dict[str, dict[str, int]]:
    """What each key was billed since `before`, once the kept key's bill reaches `served`
    (settlements that waited out the Redis outage retry with backoff), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {name: usage(url, key) for name, key in keys.items()}
        billed = {name: {k: now[name][k] - before[name][k] for k in now[name]} for name in keys}
        if billed["kept"]["completion_tokens"] >= served or time.monotonic() > deadline:
            return billed
        time.sleep(1)


def check(results: dict[str, Any], name: str, ok: bool, detail: str) -> None:
    results["checks"].append({"check": name, "ok": bool(ok), "detail": detail})


def run_checks(results: dict[str, Any], tally: Tally, window: list[float], idle: dict,
               rss: dict[str, float], billed: dict[str, dict[str, int]], generated: float,
               ) -> None:
    failed = [r.detail for r in tally.results if r.outcome == "failed"]
    check(results, "no failures", not failed, f"{len(failed)} failed; first: {failed[:5]}")
    start, end = (window + [float("inf")] * 2)[:2]
    stray = [r for r in tally.results if r.outcome == "unavailable"
             and not start <= r.at <= end + 10]
    check(results, "503 only while Redis is away", not stray,
          f"{tally.count('unavailable')} answered 503, {len(stray)} outside the outage")
    counts = tally.summary()
    check(results, "traffic of every kind", counts["ok"] and counts["cut"]
          and counts["client_error"], json.dumps(counts))
    check(results, "KV blocks back to idle", not any(idle.values()), json.dumps(idle))
    grown = rss["final"] / rss["warm"] - 1
    check(results, "RSS within 10% of warm-up", grown <= 0.10,
          f"{rss['warm']:.0f} MiB after warm-up, {rss['final']:.0f} MiB at the end "
          f"({grown:+.1%}; peak {rss['peak']:.0f} MiB)")
    kept, served = billed["kept"], tally.tokens("kept")
    check(results, "kept key: usage == tokens served",
          kept["completion_tokens"] == served and kept["requests"] == tally.count("ok", "kept"),
          f"Redis {kept}; served {served} tokens in {tally.count('ok', 'kept')} requests")
    low, high = tally.tokens("cut", ("ok", "cut")), tally.asked("cut")
    cut = billed["cut"]["completion_tokens"]
    check(results, "cut key: read <= usage <= asked", low <= cut <= high,
          f"clients read {low}, Redis {cut}, asked at most {high}")
    total = kept["completion_tokens"] + cut
    check(results, "server counter between kept and total usage",
          served <= generated <= total,
          f"switchyard_generated_tokens_total grew {generated:.0f}; kept {served}, "
          f"both keys {total}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--model", default="random",
                   help="random (a tiny random Llama, written here) | default | a model path")
    p.add_argument("--batch-size", type=int, default=8, help="the server's --max-batch-size")
    p.add_argument("--concurrency", type=int, help="clients (default: 2x --batch-size)")
    p.add_argument("--kv-tokens", type=int, default=2048, help="--max-batch-total-tokens")
    p.add_argument("--cut-share", type=float, default=0.3, help="streams left midway")
    p.add_argument("--bad-share", type=float, default=0.08, help="requests with a bad body")
    p.add_argument("--request-timeout-s", type=float, default=120.0,
                   help="a request without its answer by then counts as a hang")
    p.add_argument("--server-args", default="", help="more `serve` flags, one string")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    args.concurrency = args.concurrency or 2 * args.batch_size
    return args


def model_path(choice: str, folder: Path) -> str:
    if choice != "random":
        return choice
    from bench.common import write_random_llama

    return str(write_random_llama(
        folder / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=49152))


def soak(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"minutes": args.minutes, "concurrency": args.concurrency,
                               "checks": []}
    redis = Redis(folder)
    redis.start()
    server = Server(model_path(args.model, folder), redis.url, args, folder / "server.log")
    try:
        server.start()
        keys = create_keys(server.url)
        total = args.minutes * 60
        warm_s = min(max(20.0, 0.15 * total), 120.0)
        tally, window = Tally(), []
        asyncio.run(drive(server.url, keys, warm_s, args, Tally(), seed=1))
        wait_idle(server.url)
        time.sleep(1)
        rss = {"warm": server.rss_mib()}
        before = {name: usage(server.url, key) for name, key in keys.items()}
        generated = metric(scrape(server.url), "switchyard_generated_tokens_total")
        main_s = total - warm_s
        print(f"warm-up {warm_s:.0f}s done (RSS {rss['warm']:.0f} MiB); soaking {main_s:.0f}s")
        rss["peak"] = asyncio.run(_main_phase(server, redis, keys, main_s, args, tally, window))
        idle = wait_idle(server.url)
        time.sleep(1)
        rss["final"] = server.rss_mib()
        rss["peak"] = max(rss["peak"], rss["final"])
        billed = settled_usage(server.url, keys, before, tally.tokens("kept"))
        generated = metric(scrape(server.url), "switchyard_generated_tokens_total") - generated
        results.update(outcomes=tally.summary(), rss_mib=rss, usage=billed, idle=idle,
                       redis_outage_s=(window[1] - window[0]) if len(window) == 2 else None,
                       requests=len(tally.results))
        run_checks(results, tally, window, idle, rss, billed, generated)
        results["server_exit_ok"] = server.proc is not None and server.proc.poll() is None
        check(results, "server alive", results["server_exit_ok"], "")
    finally:
        server.stop()
        redis.kill()
    return results


async def _main_phase(server: Server, redis: Redis, keys: dict[str, str], seconds: float,
                      args: argparse.Namespace, tally: Tally, window: list[float]) -> float:
    """The soak proper, with the Redis outage midway; returns the peak RSS sampled (MiB)."""
    peak = 0.0

    async def sample() -> None:
        nonlocal peak
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            peak = max(peak, server.rss_mib())
            await asyncio.sleep(2)

    outage = redis_outage(redis, seconds / 2, min(5.0, seconds / 10), window)
    await asyncio.gather(drive(server.url, keys, seconds, args, tally, seed=2), outage,
                         sample())
    return peak


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="switchyard-soak-") as tmp:
        results = soak(args, Path(tmp))
    for item in results["checks"]:
        print(f"{'PASS' if item['ok'] else 'FAIL'}  {item['check']}: {item['detail']}")
    print(json.dumps({k: results[k] for k in ("requests", "outcomes", "usage", "rss_mib")}))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(item["ok"] for item in results["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
