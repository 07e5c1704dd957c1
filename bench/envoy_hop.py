"""Added latency of the Envoy hop: a gateway called directly vs through envoy/envoy.yaml.

Starts one gateway process serving a null backend (one token at once, no model: what is
left is HTTP) and a real `envoy` running the shipped envoy/envoy.yaml, with only its
addresses rewritten to loopback (tests/deploy/envoy_proxy.py), both compose upstreams
pointing at that gateway. One client sends sequential requests, alternating direct and
through Envoy so drift hits both alike:

- `plain`: a non-streamed chat completion, send to last byte;
- `ttft`: a streamed one, send to the first chunk with content (vLLM's TTFT).

It prints p50/p99 per arm and what Envoy adds. Target: < 2 ms added at p50.

    .venv/bin/python -m bench.envoy_hop [--requests 2000] [--warmup 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.auth_latency import free_port, start_gateway
from bench.common import facts_line, machine_facts, write_json
from bench.gateway_process import percentiles
from tests.deploy.envoy_proxy import EnvoyProcess, upstream_names

BODY = {"model": "null", "messages": [{"role": "user", "content": "one two three four"}],
        "max_tokens": 1}
HEADERS = {"Authorization": "Bearer none", "x-model": "null"}


def plain(client: httpx.Client) -> float:
    began = time.perf_counter()
    response = client.post("/v1/chat/completions", json=BODY)
    elapsed = time.perf_counter() - began
    if response.status_code != 200:
        raise SystemExit(f"HTTP {response.status_code}: {response.text}")
    return elapsed


def ttft(client: httpx.Client) -> float:
    began = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as reply:
        if reply.status_code != 200:
            raise SystemExit(f"HTTP {reply.status_code}: {reply.read()!r}")
        elapsed = None
        for line in reply.iter_lines():  # to the end: the connection is then reused
            if elapsed is None and '"content":"' in line.replace(" ", ""):
                elapsed = time.perf_counter() - began
    if elapsed is None:
        raise SystemExit("the stream had no content chunk")
    return elapsed


def measure(urls: dict[str, str], probe: Callable[[httpx.Client], float], requests: int,
            warmup: int) -> dict[str, list[float]]:
    clients = {name: httpx.Client(base_url=url, timeout=10, headers=HEADERS)
               for name, url in urls.items()}
    times: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for i in range(warmup + requests):
            for name, client in clients.items():
                elapsed = probe(client)
                if i >= warmup:
                    times[name].append(elapsed)
    finally:
        for client in clients.values():
            client.close()
    return times


def report(kind: str, times: dict[str, list[float]]) -> dict[str, float]:
    d50, d99 = percentiles(times["direct"])
    e50, e99 = percentiles(times["envoy"])
    print(f"{kind:<34}{d50:>9.3f}{d99:>9.3f}{e50:>9.3f}{e99:>9.3f}"
          f"{e50 - d50:>+10.3f}{e99 - d99:>+10.3f}")
    return {"direct_p50_ms": d50, "direct_p99_ms": d99, "envoy_p50_ms": e50,
            "envoy_p99_ms": e99, "added_p50_ms": e50 - d50, "added_p99_ms": e99 - d99}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write figures + machine facts here")
    args = parser.parse_args()
    facts = machine_facts(None, threads=1)  # no model: HTTP only
    print(facts_line(facts))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        gateway, url = start_gateway(folder, "direct", None)
        port = int(url.rsplit(":", 1)[1])
        upstreams = {name: port for name in upstream_names()}  # all this one gateway
        envoy = EnvoyProcess(folder, free_port(), free_port(), upstreams)
        try:
            envoy.start(healthy_hosts=len(upstreams))
            urls = {"direct": url, "envoy": envoy.url}
            print(f"\nenvoy hop: {args.requests} sequential requests per arm, alternating, "
                  f"loopback, null backend, envoy --concurrency 1\n")
            print(f"{'':<34}{'direct':>18}{'envoy':>18}{'added':>20}")
            print(f"{'ms':<34}{'p50':>9}{'p99':>9}{'p50':>9}{'p99':>9}{'p50':>10}{'p99':>10}")
            results = {
                "plain": report("non-streamed, send to last byte",
                                measure(urls, plain, args.requests, args.warmup)),
                "ttft": report("streamed, TTFT (first content)",
                               measure(urls, ttft, args.requests, args.warmup)),
            }
            write_json(args.json, facts, results)
        finally:
            envoy.stop()
            gateway.terminate()
            gateway.wait(10)


if __name__ == "__main__":
    main()
