"""Added latency of the remote backend's hop: a Switchyard in front of another Switchyard.

Two gateway processes: `upstream` serves a fast backend (8 tokens at once, no model: what
is left is HTTP and gateway work), `hop` serves the same name through `backend: remote`
pointing at `upstream`'s /v1. One client sends sequential completions, round-robin over
the arms (drift hits every arm alike):

- non-streamed latency, `direct` (to upstream) vs `hop`;
- streaming TTFT (the first content chunk), `direct` vs `hop`;
- the backend alone, in this process: RemoteBackend.generate vs a raw aiohttp session (the
  backend's transport) reading the same upstream stream (the hop minus the outer gateway's
  own work).

Prints p50/p99 per arm and what the hop adds. Target: < 2 ms added at p50.

    .venv/bin/python -m bench.remote_hop [--requests 1000] [--warmup 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import httpx

from backends.base import (
    GenerationRequest,
)
from bench.common import facts_line, machine_facts, write_json
from bench.gateway_process import InstantBackend, percentiles, serve_app, wait_for_gateway

MODEL = "fast"
BODY = {"model": MODEL, "prompt": "one two three four", "max_tokens": 8, "temperature": 0}


def serve(port_file: str, upstream: str | None) -> None:
    from backends.registry import BackendSpec, create_backend
    from gateway.app import create_app
    from gateway.settings import Settings

    backend = InstantBackend(MODEL, tokens=8) if upstream is None else create_backend(
        BackendSpec(name=MODEL, model_id="unused", backend="remote",
                    options={"base_url": upstream}))
    app = create_app(Settings(model_id=MODEL, log_level="warning"), backends={MODEL: backend})
    serve_app(app, port_file)


def start_gateway(folder: Path, name: str, upstream: str | None) -> tuple[subprocess.Popen, str]:
    port_file = folder / f"{name}.port"
    argv = [sys.executable, "-m", "bench.remote_hop", "--serve", str(port_file)]
    if upstream:
        argv += ["--upstream", upstream]
    proc = subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, wait_for_gateway(port_file, name)


def whole(client: httpx.Client) -> float:
    began = time.perf_counter()
    response = client.post("/v1/completions", json=BODY)
    elapsed = time.perf_counter() - began
    assert response.status_code == 200 and response.json()["choices"][0]["text"], response.text
    return elapsed


def _has_text(data: str) -> bool:
    if data.strip() == "[DONE]":
        return False
    chunk = json.loads(data)
    return isinstance(chunk, dict) and bool(chunk.get("choices")
                                            and chunk["choices"][0].get("text"))


def ttft(client: httpx.Client) -> float:
    began = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():  # read it all, so the connection is reused
            if first is None and line.startswith("data:") and _has_text(line[5:]):
                first = time.perf_counter() - began
    assert first is not None, "no content chunk"
    return first


def measure(urls: dict[str, str], requests: int, warmup: int) -> dict[str, list[float]]:
    clients = {name: httpx.Client(base_url=url, timeout=10) for name, url in urls.items()}
    probes: dict[str, Callable[[httpx.Client], float]] = {"latency": whole, "ttft": ttft}
    times: dict[str, list[float]] = {f"{p} {n}": [] for p in probes for n in urls}
    for i in range(warmup + requests):
        for probe_name, probe in probes.items():
            for name, client in clients.items():
                elapsed = probe(client)
                if i >= warmup:
                    times[f"{probe_name} {name}"].append(elapsed)
    for client in clients.values():
        client.close()
    return times


async def backend_alone(upstream: str, requests: int, warmup: int) -> dict[str, list[float]]:
    """In this process: RemoteBackend.generate to its last event vs raw aiohttp reading the
    same upstream stream (what any client pays): the backend's own share of the hop."""
    from backends.base import SamplingParams
    from backends.registry import BackendSpec, create_backend

    backend = create_backend(BackendSpec(name=MODEL, model_id="unused", backend="remote",
                                         options={"base_url": f"{upstream}/v1"}))
    await backend.start()
    raw_client = aiohttp.ClientSession()
    raw_url = f"{upstream}/v1/completions"
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    req = GenerationRequest("bench", SamplingParams(max_tokens=8, temperature=0),
                            prompt=str(BODY["prompt"]))

    async def raw() -> None:
        async with raw_client.post(raw_url, json=body) as response:
            async for line in response.content:
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    json.loads(line[5:])

    async def remote() -> None:
        async for _ in backend.generate(req):
            pass

    times: dict[str, list[float]] = {"alone raw": [], "alone remote": []}
    arms = [("alone raw", raw), ("alone remote", remote)]
    for i in range(warmup + requests):
        # Alternate which goes first: with a fixed order, arms doing the same work came
        # out up to 0.4 ms apart at p50 on a busy machine.
        for name, call in arms if i % 2 else arms[::-1]:
            began = time.perf_counter()
            await call()
            if i >= warmup:
                times[name].append(time.perf_counter() - began)
    await raw_client.close()
    await backend.close()
    return times


def report(times: dict[str, list[float]]) -> dict[str, float]:
    results: dict[str, float] = {}
    for arm, samples in times.items():
        p50, p99 = percentiles(samples)
        results[f"{arm} p50_ms"], results[f"{arm} p99_ms"] = p50, p99
        print(f"{arm:16s} p50 {p50:7.3f} ms   p99 {p99:7.3f} ms")
    for probe, (base, arm) in (("latency", ("direct", "hop")), ("ttft", ("direct", "hop")),
                               ("alone", ("raw", "remote"))):
        for q in ("p50", "p99"):
            added = results[f"{probe} {arm} {q}_ms"] - results[f"{probe} {base} {q}_ms"]
            results[f"{probe} added {q}_ms"] = added
            print(f"{probe:8s} added by the hop at {q}: {added:6.3f} ms")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--json", default=None)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.upstream)
        return
    facts = machine_facts(None, 1)
    print(facts_line(facts))
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as folder:
        try:
            proc, direct = start_gateway(Path(folder), "upstream", None)
            procs.append(proc)
            proc, hop = start_gateway(Path(folder), "hop", f"{direct}/v1")
            procs.append(proc)
            times = measure({"direct": direct, "hop": hop}, args.requests, args.warmup)
            times.update(asyncio.run(backend_alone(direct, args.requests, args.warmup)))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    print(f"{args.requests} sequential requests per arm, round-robin")
    write_json(args.json, facts, report(times))


if __name__ == "__main__":
    main()
