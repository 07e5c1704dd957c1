"""Envoy in front of two `switchyard serve` replicas sharing one Redis, all real processes.

The Envoy config is the shipped envoy/envoy.yaml with only addresses and ports rewritten
(tests/deploy/envoy_proxy.py). Both replicas serve two tiny models, `default` and
`second`; envoy.yaml gives `default` its own cluster, so `x-model: default` goes there
and anything else to the pool of all replicas.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.deploy.conftest import ADMIN_KEY, Topology

PROMPT = [{"role": "user", "content": "Tell me about the rivers of Europe."}]


def chat(url: str, key: str, x_model: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"x-model": x_model} if x_model else {})}
    payload = {"messages": PROMPT, "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, headers=headers, timeout=60)


def upstream_requests(topology: Topology) -> dict[str, int]:
    return {cluster: topology.envoy.stat(f"cluster.{cluster}.upstream_rq_total")
            for cluster in ("model_default", "gateways")}


def served_by(topology: Topology, before: dict[str, int], cluster: str = "model_default",
              counter: str = "rq_success") -> dict[str, int]:
    """Requests each replica ("127.0.0.1:<port>") completed since `before` (Envoy's admin
    counters: no response names the replica)."""
    after = topology.envoy.host_counters(cluster, counter)
    return {host: after[host] - before.get(host, 0) for host in after
            if after[host] > before.get(host, 0)}


def test_x_model_picks_the_per_model_cluster(topology: Topology) -> None:
    url = topology.envoy.url
    cases = [  # (x-model header, body model, cluster Envoy must pick, model served)
        ("default", None, "model_default", "default"),
        ("second", None, "gateways", "second"),
        (None, "second", "gateways", "second"),
        ("default", "second", "model_default", "default"),  # the header wins, here too
    ]
    for header, body_model, cluster, served in cases:
        before = upstream_requests(topology)
        body = {"model": body_model} if body_model else {}
        answer = chat(url, ADMIN_KEY, header, **body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == served
        after = upstream_requests(topology)
        delta = {name: after[name] - before[name] for name in after}
        assert delta == {name: int(name == cluster) for name in after}, (header, delta)
        assert "x-switchyard-upstream" not in answer.headers  # replicas stay unnamed
        assert not any(f":{g.port}" in value for g in topology.gateways.values()
                       for value in answer.headers.values()), dict(answer.headers)


def test_the_openai_sdk_streams_through_envoy_chunk_by_chunk(topology: Topology) -> None:
    client = openai.OpenAI(base_url=f"{topology.envoy.url}/v1", api_key=ADMIN_KEY,
                           max_retries=0, default_headers={"x-model": "default"})
    sent = time.perf_counter()
    stream = client.chat.completions.create(
        model="default", messages=PROMPT, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    arrivals = [time.perf_counter() - sent for chunk in stream
                if chunk.choices and chunk.choices[0].delta.content]
    assert len(arrivals) >= 150  # one chunk per token, bar merged multi-byte pieces
    first, last = arrivals[0], arrivals[-1]
    # Buffered, every chunk would land together at the end; streamed, the first lands
    # after prefill and the rest spread over the 200 decode steps.
    assert last - first > 0.5 * last, (first, last)
    assert len({round(t, 3) for t in arrivals}) > len(arrivals) // 4  # many distinct times


def test_a_per_key_limit_is_exact_across_replicas_behind_envoy(topology: Topology) -> None:
    made = topology.create_key(name="behind-envoy", rpm=6)
    before = topology.envoy.host_counters("model_default", "rq_total")
    with ThreadPoolExecutor(12) as pool:  # 12 at once; least-request spreads them
        answers = list(pool.map(
            lambda _: chat(topology.envoy.url, made["key"], "default"), range(12)))
    codes = sorted(answer.status_code for answer in answers)
    assert codes == [200] * 6 + [429] * 6, codes
    took_part = served_by(topology, before, counter="rq_total")
    assert len(took_part) == 2, took_part  # both replicas took part
    for refused in (a for a in answers if a.status_code == 429):
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["x-ratelimit-limit-requests"] == "6"
    usage = httpx.get(f"{topology.envoy.url}/admin/keys/{made['id']}/usage", timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert sum(row["requests"] for row in usage["data"]) == 6


def test_a_client_leaving_mid_stream_is_charged_what_it_used(topology: Topology) -> None:
    made = topology.create_key(name="leaves", parallel=1)
    body = {"messages": PROMPT, "max_tokens": 450, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {made['key']}", "x-model": "default"}
    with httpx.stream("POST", f"{topology.envoy.url}/v1/chat/completions", json=body,
                      headers=headers, timeout=30) as response:
        assert response.status_code == 200
        frames = (line for line in response.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(frames)
    # Envoy resets the upstream request; the replica aborts and settles what was used.
    usage_url = f"{topology.envoy.url}/admin/keys/{made['id']}/usage"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    deadline = time.monotonic() + 10
    rows: list[dict[str, Any]] = []
    while not rows and time.monotonic() < deadline:
        rows = httpx.get(usage_url, headers=admin, timeout=10).json()["data"]
        time.sleep(0.05)
    assert rows and rows[0]["requests"] == 1, rows
    assert 1 <= rows[0]["completion_tokens"] < 450
    assert chat(topology.envoy.url, made["key"], "default").status_code == 200  # slot freed


@pytest.fixture
def crashed_replica(topology: Topology) -> Any:
    """gateway-2 killed (SIGKILL); started again on the same port afterwards."""
    victim = topology.gateways["gateway-2"]
    victim.kill()
    yield victim
    victim.start()
    victim.wait_ready()
    for cluster in ("gateways", "model_default"):
        topology.envoy.wait_healthy(cluster, len(topology.gateways))


def test_requests_keep_succeeding_when_a_replica_dies(
    topology: Topology, crashed_replica: Any,
) -> None:
    survivor = f"127.0.0.1:{topology.gateways['gateway-1'].port}"
    retries_before = topology.envoy.stat("cluster.model_default.upstream_rq_retry")
    before = topology.envoy.host_counters("model_default", "rq_success")
    # At once, before any health check noticed: refused connections are retried elsewhere.
    for _ in range(12):  # each finds the dead replica about half the time
        answer = chat(topology.envoy.url, ADMIN_KEY, "default")
        assert answer.status_code == 200, answer.text
    assert served_by(topology, before) == {survivor: 12}
    # Then the active health check takes the dead replica out of both clusters.
    for cluster in ("gateways", "model_default"):
        topology.envoy.wait_healthy(cluster, 1, timeout_s=30)
    assert topology.envoy.stat("cluster.model_default.upstream_rq_retry") > retries_before
    for model in ("default", "second"):
        assert chat(topology.envoy.url, ADMIN_KEY, model).status_code == 200


def test_metrics_is_scraped_from_the_replicas_not_through_envoy(topology: Topology) -> None:
    made = topology.create_key(name="metered")
    assert chat(topology.envoy.url, made["key"], "default").status_code == 200
    for path in ("/metrics", "/metrics?x=1", "//metrics", "/%6Detrics", "/%2Fmetrics"):
        answer = httpx.get(f"{topology.envoy.url}{path}", timeout=10)
        assert answer.status_code == 404, (path, answer.status_code)
        assert made["id"] not in answer.text and "key_id" not in answer.text, path
    # Prometheus scrapes each replica directly; there the series are
    scraped = "".join(httpx.get(f"{g.url}/metrics", timeout=10).text
                      for g in topology.gateways.values())
    assert f'key_id="{made["id"]}"' in scraped
