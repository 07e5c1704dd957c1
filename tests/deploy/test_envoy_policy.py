"""The shipped envoy/envoy.yaml, run by a real envoy, against what an attacker or an overload
does: retries only for requests that never reached a replica, no upstream address in any
response, and no route to /metrics however its path is spelt.

The replicas here are stand-ins (tests/deploy/stub_replica.py) that answer 503 or drop the
connection on every POST and count what they received; tests/deploy/test_topology.py runs
the same config in front of real `switchyard serve` replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from posixpath import normpath
from urllib.parse import unquote, urlsplit

import httpx
import pytest

from tests.deploy.envoy_proxy import EnvoyProcess, upstream_names
from tests.deploy.gateways import free_port
from tests.deploy.stub_replica import Behaviour, StubReplica

SetBehaviour = Callable[[Behaviour], None]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# Each is /metrics to the gateway (uvicorn percent-decodes; a dot segment or a doubled slash
# resolves), so none may reach a replica.
METRICS_SPELLINGS = ["/metrics", "/metrics?name[]=tgi_queue_size", "/metrics/", "//metrics",
                     "/./metrics", "/v1/../metrics", "/%6Detrics", "/%6d%65trics",
                     "/%2Fmetrics", "/metrics%2F", "/v1/%2E%2E/metrics", "/%2e/metrics"]


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, StubReplica]]:
    stubs = {name: StubReplica(name) for name in sorted(upstream_names())}
    for stub in stubs.values():
        stub.start()
    yield stubs
    for stub in stubs.values():
        stub.stop()


@pytest.fixture(scope="module")
def envoy(replicas: dict[str, StubReplica],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyProcess]:
    proxy = EnvoyProcess(tmp_path_factory.mktemp("envoy-policy"), free_port(), free_port(),
                         {name: stub.port for name, stub in replicas.items()})
    proxy.start(healthy_hosts=len(replicas))
    proxy.wait_healthy("model_default", len(replicas))
    yield proxy
    proxy.stop()


@pytest.fixture
def behave(replicas: dict[str, StubReplica]) -> Iterator[SetBehaviour]:
    """Sets every replica's behaviour and forgets what they received; back to "ok" after."""

    def set_all(behaviour: Behaviour) -> None:
        for stub in replicas.values():
            stub.behaviour = behaviour
            stub.received.clear()

    yield set_all
    set_all("ok")


def _posts(replicas: dict[str, StubReplica]) -> int:
    return sum(stub.posts() for stub in replicas.values())


@pytest.mark.parametrize("x_model", [None, "default"])  # the pool, and a model's cluster
def test_a_post_a_replica_answered_503_is_not_retried(
        envoy: EnvoyProcess, replicas: dict[str, StubReplica], behave: SetBehaviour,
        x_model: str | None) -> None:
    behave("503")
    retries = envoy.stat("cluster.gateways.upstream_rq_retry") + envoy.stat(
        "cluster.model_default.upstream_rq_retry")
    headers = {"x-model": x_model} if x_model else {}
    answer = httpx.post(f"{envoy.url}/v1/chat/completions", json=CHAT, headers=headers,
                        timeout=30)
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "queue_timeout"  # the replica's own answer
    assert answer.headers["retry-after"] == "1"
    assert _posts(replicas) == 1, [stub.received for stub in replicas.values()]
    assert envoy.stat("cluster.gateways.upstream_rq_retry") + envoy.stat(
        "cluster.model_default.upstream_rq_retry") == retries


def test_a_post_whose_replica_died_mid_request_is_not_replayed(
        envoy: EnvoyProcess, replicas: dict[str, StubReplica], behave: SetBehaviour) -> None:
    behave("reset")
    answer = httpx.post(f"{envoy.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert answer.status_code == 503  # Envoy's: upstream reset
    assert _posts(replicas) == 1, [stub.received for stub in replicas.values()]


def test_a_refused_connection_is_tried_on_another_replica(
        envoy: EnvoyProcess, replicas: dict[str, StubReplica], behave: SetBehaviour) -> None:
    behave("ok")
    dead, live = replicas["gateway-2"], replicas["gateway-1"]
    port = dead.port
    retries = envoy.stat("cluster.gateways.upstream_rq_retry")
    dead.stop()  # at once, before a health check notices: its port refuses connections
    try:
        for _ in range(16):  # each finds the dead replica about half the time
            answer = httpx.post(f"{envoy.url}/v1/chat/completions", json=CHAT, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"served_by": live.name}
        assert live.posts() == 16
        assert envoy.stat("cluster.gateways.upstream_rq_retry") > retries
    finally:
        dead.start(port)
        for cluster in ("gateways", "model_default"):
            envoy.wait_healthy(cluster, len(replicas))


def test_a_post_a_draining_replica_refused_is_tried_on_another(
        envoy: EnvoyProcess, replicas: dict[str, StubReplica], behave: SetBehaviour) -> None:
    """A draining replica refuses before any work and says so: the request goes elsewhere
    (a rolling restart loses nothing), once."""
    behave("ok")
    draining, live = replicas["gateway-2"], replicas["gateway-1"]
    draining.behaviour = "draining"
    for _ in range(16):  # each finds the draining replica about half the time
        answer = httpx.post(f"{envoy.url}/v1/chat/completions", json=CHAT, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"served_by": live.name}
    assert live.posts() == 16
    assert draining.posts() > 0  # it was tried, and refused


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions")])
def test_no_response_names_a_replica(envoy: EnvoyProcess, replicas: dict[str, StubReplica],
                                     behave: SetBehaviour, method: str, path: str) -> None:
    behave("ok")
    answer = httpx.request(method, f"{envoy.url}{path}", json=CHAT, timeout=30)
    assert answer.status_code == 200
    assert "x-switchyard-upstream" not in answer.headers
    for stub in replicas.values():
        for name, value in answer.headers.items():
            assert str(stub.port) not in value and "127.0.0.1" not in value, (name, value)


@pytest.mark.parametrize("path", METRICS_SPELLINGS)
def test_metrics_is_not_routed_however_spelt(envoy: EnvoyProcess,
                                             replicas: dict[str, StubReplica],
                                             behave: SetBehaviour, path: str) -> None:
    behave("ok")
    with httpx.Client(timeout=30) as client:  # the path goes out as written
        request = client.build_request("GET", envoy.url)
        request.url = request.url.copy_with(raw_path=path.encode())
        answer = client.send(request)
    assert 400 <= answer.status_code < 500, (path, answer.status_code)
    assert b"key_id" not in answer.content
    for stub in replicas.values():
        for got in stub.received:
            as_gateway_sees_it = normpath("/" + unquote(urlsplit(got.path).path).lstrip("/"))
            assert not as_gateway_sees_it.startswith("/metrics"), (path, got.path)


def test_other_paths_still_reach_the_replicas(envoy: EnvoyProcess,
                                             replicas: dict[str, StubReplica],
                                             behave: SetBehaviour) -> None:
    behave("ok")
    for path in ("/v1/models", "/metricsx", "/v1/metrics", "/info"):
        answer = httpx.get(f"{envoy.url}{path}", timeout=30)
        assert answer.status_code == 200 and answer.json() == {"path": path}, path
    # the OpenAI SDK's models.retrieve("org/name"); the gateway decodes %2F the same way
    answer = httpx.get(f"{envoy.url}/v1/models/org%2Fname", timeout=30)
    assert answer.status_code == 200 and answer.json() == {"path": "/v1/models/org/name"}
