"""deploy/k8s is secure by default, checked on what `kubectl apply -k` would send.

No Secret (and no placeholder) ships: the pods read Secrets the user creates with the
README's commands. Redis runs with a password from such a Secret (a real redis-server, given
the StatefulSet's own args, refuses an unauthenticated SET; the gateway's URL gets in) and a
NetworkPolicy admits only the gateway pods. Both workloads are non-root, seccomp
RuntimeDefault, capability-free, with read-only root filesystems, pinned images, and a
writable volume under every path the gateway writes to.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from auth.admin_key import check_admin_key
from tests.auth.password_redis import PasswordRedis
from tests.deploy.k8s_objects import Doc, environment, expanded_args, kustomized, user_secrets

PINNED = re.compile(r"^[\w./-]+(:v?\d+\.\d+\.\d+[\w.-]*|@sha256:[0-9a-f]{64})$")
PLACEHOLDER = re.compile(r"change[-_]?me|replace[-_]?me|placeholder", re.IGNORECASE)


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], Doc]:
    return {(d["kind"], d["metadata"]["name"]): d for d in kustomized()}


@pytest.fixture(scope="module")
def secrets() -> dict[str, dict[str, str]]:
    return user_secrets()


def _workloads(objects: dict[tuple[str, str], Doc]) -> dict[str, Doc]:
    """Pod specs by workload name."""
    return {name: d["spec"]["template"]["spec"] for (kind, name), d in objects.items()
            if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job")}


def _env(objects: dict[tuple[str, str], Doc], container: Doc,
         secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    config_maps = {name: d["data"] for (kind, name), d in objects.items() if kind == "ConfigMap"}
    return environment(container, config_maps, secrets)


def _container(objects: dict[tuple[str, str], Doc], kind: str, name: str) -> Doc:
    (container,) = objects[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return container


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


# ---- secrets -------------------------------------------------------------------------------

def test_apply_installs_no_secret_and_no_placeholder(objects: dict[tuple[str, str], Doc]) -> None:
    assert [key for key in objects if key[0] == "Secret"] == []
    text = yaml.safe_dump_all(list(objects.values()))
    assert not PLACEHOLDER.search(text), PLACEHOLDER.search(text)
    for spec in _workloads(objects).values():
        for container in spec["containers"]:
            for var in container.get("env", []):  # secrets only by reference
                if re.search(r"KEY|PASSWORD|TOKEN|SECRET", var["name"]):
                    assert "valueFrom" in var, var
    for (kind, _), doc in objects.items():
        if kind == "ConfigMap":
            assert not any(re.search(r"KEY$|PASSWORD", k) for k in doc["data"]), doc["data"]


def test_the_pods_read_exactly_the_secrets_the_readme_creates(
        objects: dict[tuple[str, str], Doc], secrets: dict[str, dict[str, str]]) -> None:
    wanted = {(ref["name"], ref["key"])
              for spec in _workloads(objects).values() for c in spec["containers"]
              for var in c.get("env", []) if "valueFrom" in var
              for ref in [var["valueFrom"]["secretKeyRef"]]}
    made = {(name, key) for name, data in secrets.items() for key in data}
    assert wanted == made, (wanted, made)
    check_admin_key(secrets["switchyard-admin"]["SWITCHYARD_ADMIN_KEY"])  # the server takes it
    assert re.fullmatch(r"[0-9a-f]{64}", secrets["switchyard-redis"]["REDIS_PASSWORD"])


# ---- redis: a password and a network policy ------------------------------------------------

@pytest.fixture(scope="module")
def k8s_redis(objects: dict[tuple[str, str], Doc], secrets: dict[str, dict[str, str]],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordRedis]:
    """redis-server with the StatefulSet's args, as the kubelet expands them."""
    container = _container(objects, "StatefulSet", "switchyard-redis")
    env = _env(objects, container, secrets)
    gateway_env = _env(objects, _container(objects, "Deployment", "switchyard"), secrets)
    server = PasswordRedis(tmp_path_factory.mktemp("k8s-redis"), expanded_args(container, env),
                           secrets["switchyard-redis"]["REDIS_PASSWORD"],
                           urlsplit(gateway_env["SWITCHYARD_REDIS_URL"]).username)
    server.start()
    yield server
    server.stop()


def test_redis_refuses_a_client_without_the_password(k8s_redis: PasswordRedis) -> None:
    forged = ("SET", "sy:key:" + "0" * 64, '{"id": "key_forged"}')
    (refused,) = k8s_redis.send(forged)
    assert refused.startswith(b"-NOAUTH"), refused
    assert k8s_redis.send(("AUTH", "wrong"), forged)[1].startswith(b"-NOAUTH")
    # the default user is off, even with the password; the gateway's user gets in
    assert k8s_redis.send(("AUTH", k8s_redis.password), ("PING",))[1].startswith(b"-NOAUTH")
    assert k8s_redis.send(("AUTH", "switchyard", k8s_redis.password), ("PING",)) == [
        b"+OK", b"+PONG"]


def test_the_gateway_url_carries_the_password(objects: dict[tuple[str, str], Doc],
                                             secrets: dict[str, dict[str, str]],
                                             k8s_redis: PasswordRedis) -> None:
    env = _env(objects, _container(objects, "Deployment", "switchyard"), secrets)
    url = env["SWITCHYARD_REDIS_URL"]
    assert "$(" not in url, url  # every reference defined before it
    local = re.sub(r"@[\w.-]+:\d+/", f"@127.0.0.1:{k8s_redis.port}/", url)
    with redis.Redis.from_url(local) as client:
        assert client.set("sy:probe", "1")


def test_the_redis_probes_authenticate(objects: dict[tuple[str, str], Doc],
                                       secrets: dict[str, dict[str, str]],
                                       k8s_redis: PasswordRedis) -> None:
    container = _container(objects, "StatefulSet", "switchyard-redis")
    env = _env(objects, container, secrets)
    for kind in ("readinessProbe", "livenessProbe"):
        command = container[kind]["exec"]["command"]
        local = [part.replace("redis-cli", f"redis-cli -p {k8s_redis.port}") for part in command]
        base = {"PATH": os.environ["PATH"]}
        assert subprocess.run(local, env={**base, **env}, timeout=10).returncode == 0, kind
        # without the password the probe fails (a bare `redis-cli ping` exits 0 on NOAUTH)
        assert subprocess.run(local, env=base, timeout=10, capture_output=True).returncode != 0


def test_only_gateway_pods_may_connect_to_redis(objects: dict[tuple[str, str], Doc]) -> None:
    redis_pods = objects[("StatefulSet", "switchyard-redis")]["spec"]["template"]
    gateway_pods = objects[("Deployment", "switchyard")]["spec"]["template"]
    policies = [d for (kind, _), d in objects.items() if kind == "NetworkPolicy"
                and _matches(d["spec"]["podSelector"]["matchLabels"],
                             redis_pods["metadata"]["labels"])]
    assert len(policies) == 1, policies
    spec = policies[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector, no ipBlock: this namespace
    selector = peer["podSelector"]["matchLabels"]
    assert _matches(selector, gateway_pods["metadata"]["labels"])
    for other in (redis_pods["metadata"]["labels"], {"run": "debug"},
                  {"app.kubernetes.io/part-of": "switchyard"},
                  {"app.kubernetes.io/name": "switchyard"}):
        assert not _matches(selector, other), other
    (port,) = rule["ports"]
    (container,) = redis_pods["spec"]["containers"]
    assert port["port"] in {p["containerPort"] for p in container["ports"]} | {
        p["name"] for p in container["ports"]}


# ---- pods ----------------------------------------------------------------------------------

def test_workloads_run_confined(objects: dict[tuple[str, str], Doc]) -> None:
    workloads = _workloads(objects)
    assert set(workloads) == {"switchyard", "switchyard-redis"}
    for name, spec in workloads.items():
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, name
        assert spec.get("automountServiceAccountToken") is False, name
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container.get("securityContext", {})
            seccomp = context.get("seccompProfile", pod.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", name
            assert context.get("readOnlyRootFilesystem") is True, name
            assert context.get("allowPrivilegeEscalation") is False, name
            assert context.get("capabilities", {}).get("drop") == ["ALL"], name
            assert not context.get("privileged"), name


def test_images_are_pinned_to_versions(objects: dict[tuple[str, str], Doc]) -> None:
    for name, spec in _workloads(objects).items():
        for container in spec["containers"] + spec.get("initContainers", []):
            image = container["image"]
            assert PINNED.match(image) and ":latest" not in image, (name, image)


def test_the_gateway_writes_only_to_volumes(objects: dict[tuple[str, str], Doc],
                                           secrets: dict[str, dict[str, str]]) -> None:
    spec = _workloads(objects)["switchyard"]
    (container,) = spec["containers"]
    env = _env(objects, container, secrets)
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")
                and {"emptyDir", "persistentVolumeClaim"} & set(volumes[m["name"]])}
    # the startup cache, torch.compile's temp files, and whatever a library keeps under ~
    for path in (env["SWITCHYARD_CACHE_DIR"], env.get("TMPDIR", "/tmp"), env["HOME"]):
        assert any(Path(path).is_relative_to(m) for m in writable), (path, writable)
    redis_spec = _workloads(objects)["switchyard-redis"]
    (redis_container,) = redis_spec["containers"]
    data_dir = expanded_args(redis_container, {})[redis_container["args"].index("--dir") + 1]
    assert data_dir in {m["mountPath"] for m in redis_container["volumeMounts"]}
