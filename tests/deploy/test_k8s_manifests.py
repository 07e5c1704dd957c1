"""deploy/k8s: manifests that fit together and fit the gateway they run.

Without a cluster: every document parses and (with kubernetes-validate, the API's own
OpenAPI schemas shipped in a wheel) validates strictly; the container's args parse with the
real `switchyard serve` parser and, with the ConfigMap's variables and the Secrets the
README's commands create, make valid Settings; the models file loads with the real loader;
probes and the scrape path are routes the app serves; names, labels, ports and volumes
refer to each other; the HPA's metric is one a running gateway exports, and the
prometheus-adapter rule serves it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from backends.native.config import EngineConfig
from gateway.cli import build_parser, settings_from_args
from gateway.models_file import load_config_file
from gateway.settings import Settings
from tests.deploy.k8s_objects import environment, user_secrets
from tests.deploy.metrics_exposition import Exposition, metric_names, traffic_gateway

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
ADAPTER_RULES = "prometheus-adapter-rules.yaml"
EXPECTED = {  # file -> (apiVersion, kind) of its documents
    "namespace.yaml": [("v1", "Namespace")],
    "configmap.yaml": [("v1", "ConfigMap")],
    "models-configmap.yaml": [("v1", "ConfigMap")],
    "model-pvc.yaml": [("v1", "PersistentVolumeClaim")],
    "redis.yaml": [("v1", "Service"), ("apps/v1", "StatefulSet")],
    "redis-networkpolicy.yaml": [("networking.k8s.io/v1", "NetworkPolicy")],
    "deployment.yaml": [("apps/v1", "Deployment")],
    "service.yaml": [("v1", "Service")],
    "hpa.yaml": [("autoscaling/v2", "HorizontalPodAutoscaler")],
    ADAPTER_RULES: [("v1", "ConfigMap")],
}
# Variables the pods may carry beside SWITCHYARD_* settings.
OTHER_ENV = {"HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "HOME",
             "REDIS_PASSWORD"}
Doc = dict[str, Any]


def _documents(name: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], Doc]:
    """Every manifest by (kind, name)."""
    out: dict[tuple[str, str], Doc] = {}
    for name in EXPECTED:
        for doc in _documents(name):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, key
            out[key] = doc
    return out


@pytest.fixture(scope="module")
def deployment(docs: dict[tuple[str, str], Doc]) -> Doc:
    return docs[("Deployment", "switchyard")]


@pytest.fixture(scope="module")
def container(deployment: Doc) -> Doc:
    (gateway,) = deployment["spec"]["template"]["spec"]["containers"]
    return gateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Exposition]]:
    """A running gateway (keys on, after traffic): its URL and its /metrics."""
    with traffic_gateway(tmp_path_factory.mktemp("k8s")) as running:
        yield running


@pytest.fixture(scope="module")
def exposition(gateway: tuple[str, Exposition]) -> Exposition:
    return gateway[1]


def _get(gateway: tuple[str, Exposition], path: str) -> int:
    """The status a kubelet or Prometheus (no key) gets for GET `path`."""
    return httpx.get(gateway[0] + path, timeout=10).status_code


@pytest.fixture(scope="module")
def secrets() -> dict[str, dict[str, str]]:
    """The Secrets the user creates with deploy/README.md's commands (none ship)."""
    return user_secrets()


def _environment(docs: dict[tuple[str, str], Doc], container: Doc) -> dict[str, str]:
    """The container's environment, as the kubelet would set it."""
    config_maps = {name: doc["data"] for (kind, name), doc in docs.items() if kind == "ConfigMap"}
    return environment(container, config_maps, user_secrets())


def _settings(docs: dict[tuple[str, str], Doc], container: Doc,
              monkeypatch: pytest.MonkeyPatch) -> Settings:
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve"
    for name in [n for n in os.environ if n.startswith("SWITCHYARD_")]:
        monkeypatch.delenv(name)
    for name, value in _environment(docs, container).items():
        monkeypatch.setenv(name, value)
    return settings_from_args(args)


def _quantity(value: str | int) -> float:
    units = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20,
             "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    assert match, value
    return float(match.group(1)) * units[match.group(2)]


# ---- the files ----------------------------------------------------------------------------

def test_every_manifest_has_the_expected_kinds() -> None:
    shipped = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert shipped == set(EXPECTED)
    for name, expected in EXPECTED.items():
        assert [(d["apiVersion"], d["kind"]) for d in _documents(name)] == expected, name


def test_kustomization_lists_the_manifests() -> None:
    (kustomization,) = _documents("kustomization.yaml")
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    # the adapter's rules live in the adapter's namespace, outside this kustomization
    assert set(kustomization["resources"]) == set(EXPECTED) - {ADAPTER_RULES}
    assert len(kustomization["resources"]) == len(set(kustomization["resources"]))
    (image,) = kustomization["images"]
    (namespace,) = _documents("namespace.yaml")
    assert kustomization["namespace"] == namespace["metadata"]["name"]
    (deployment,) = _documents("deployment.yaml")
    (gateway,) = deployment["spec"]["template"]["spec"]["containers"]
    assert gateway["image"].split(":")[0] == image["name"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    validator = pytest.importorskip("kubernetes_validate")
    version = "1.30.0"  # autoscaling/v2 is GA from 1.23; any recent cluster
    for doc in _documents(name):
        validator.validate(doc, version, strict=True)  # raises, naming the field


def test_the_schema_check_catches_a_misspelt_field() -> None:
    validator = pytest.importorskip("kubernetes_validate")
    (deployment,) = _documents("deployment.yaml")
    gateway = deployment["spec"]["template"]["spec"]["containers"][0]
    gateway["livenessProb"] = gateway.pop("livenessProbe")
    with pytest.raises(validator.ValidationError, match="livenessProb"):
        validator.validate(deployment, "1.30.0", strict=True)


# ---- the gateway's container --------------------------------------------------------------

def test_args_and_environment_make_valid_settings(
        docs: dict[tuple[str, str], Doc], container: Doc, monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = _settings(docs, container, monkeypatch)
    # argparse takes unambiguous abbreviations (--hostnam); the manifest spells flags whole
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    flags = {f for a in commands.choices["serve"]._actions for f in a.option_strings}
    given = [a.split("=")[0] for a in container["args"] if a.startswith("-")]
    assert given and set(given) <= flags, set(given) - flags
    (port,) = container["ports"]
    assert settings.hostname == "0.0.0.0"
    assert settings.port == port["containerPort"]
    assert settings.admin_key is not None  # keys on
    assert settings.redis_url is not None
    assert settings.metrics_auth == "open"  # Prometheus scrapes without a key


def test_environment_names_are_real_settings(docs: dict[tuple[str, str], Doc],
                                             container: Doc) -> None:
    fields = set(Settings.model_fields)
    env = _environment(docs, container)
    assert "SWITCHYARD_ADMIN_KEY" in env
    for name in env:
        if name.startswith("SWITCHYARD_"):
            assert name.removeprefix("SWITCHYARD_").lower() in fields, name
        else:
            assert name in OTHER_ENV, name


def test_the_admin_key_comes_from_the_secret(docs: dict[tuple[str, str], Doc],
                                             container: Doc,
                                             secrets: dict[str, dict[str, str]]) -> None:
    (var,) = [v for v in container["env"] if v["name"] == "SWITCHYARD_ADMIN_KEY"]
    ref = var["valueFrom"]["secretKeyRef"]
    assert ("Secret", ref["name"]) not in docs  # no Secret ships: the user makes it
    assert len(secrets[ref["name"]][ref["key"]]) >= 32  # as the README makes it
    for source in container["envFrom"]:  # and never from a ConfigMap
        assert "SWITCHYARD_ADMIN_KEY" not in docs[("ConfigMap", source["configMapRef"]["name"])][
            "data"]


def test_grace_period_outlasts_the_drain(docs: dict[tuple[str, str], Doc], deployment: Doc,
                                         container: Doc, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings(docs, container, monkeypatch)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= settings.shutdown_timeout + 10, (grace, settings.shutdown_timeout)


def test_probes_ask_health_on_the_served_port(container: Doc,
                                              gateway: tuple[str, Exposition]) -> None:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]["httpGet"]
        assert probe["path"] == "/health", kind
        assert _get(gateway, probe["path"]) == 200, kind  # ready, and open without a key
        assert probe["port"] in ports or probe["port"] in ports.values(), kind
        # /health asks each deployment for up to 5 s (gateway/service_routes.py)
        assert container[kind]["timeoutSeconds"] > 5, kind
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model load
    live, ready = container["livenessProbe"], container["readinessProbe"]
    assert (live["periodSeconds"] * live["failureThreshold"]
            > ready["periodSeconds"] * ready["failureThreshold"])


def test_prometheus_scrapes_a_served_path(deployment: Doc, container: Doc,
                                          gateway: tuple[str, Exposition]) -> None:
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert _get(gateway, notes["prometheus.io/path"]) == 200  # keys on, metrics open
    assert int(notes["prometheus.io/port"]) in {p["containerPort"] for p in container["ports"]}


def test_resources_are_requested_and_limited(docs: dict[tuple[str, str], Doc]) -> None:
    for kind, name in (("Deployment", "switchyard"), ("StatefulSet", "switchyard-redis")):
        for c in docs[(kind, name)]["spec"]["template"]["spec"]["containers"]:
            requests, limits = c["resources"]["requests"], c["resources"]["limits"]
            assert {"cpu", "memory"} <= set(requests), name
            assert "memory" in limits, name
            for resource, limit in limits.items():
                if resource in requests:
                    assert _quantity(requests[resource]) <= _quantity(limit), (name, resource)


def test_volumes_refer_to_real_objects(docs: dict[tuple[str, str], Doc], deployment: Doc,
                                       container: Doc) -> None:
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert set(mounts) == set(volumes)
    claim = volumes["models"]["persistentVolumeClaim"]
    assert ("PersistentVolumeClaim", claim["claimName"]) in docs
    assert mounts["models"]["readOnly"] and claim["readOnly"]
    for volume in volumes.values():
        if "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in docs
    # the cache the env points at is a mounted, writable volume
    env = _environment(docs, container)
    assert env["SWITCHYARD_CACHE_DIR"] in {m["mountPath"] for m in mounts.values()
                                           if not m.get("readOnly")}


# ---- the models file ----------------------------------------------------------------------

def _models_file(docs: dict[tuple[str, str], Doc], deployment: Doc, container: Doc,
                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Settings, Path]:
    settings = _settings(docs, container, monkeypatch)
    assert settings.config_file is not None
    path = Path(settings.config_file)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    data = docs[("ConfigMap", volume["configMap"]["name"])]["data"]
    local = tmp_path / path.name
    local.write_text(data[path.name])
    return settings, local


def test_the_models_file_loads_with_the_real_loader(
        docs: dict[tuple[str, str], Doc], deployment: Doc, container: Doc, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings, local = _models_file(docs, deployment, container, tmp_path, monkeypatch)
    config = load_config_file(local)
    assert config.models
    served = settings.model_copy(update={"config_file": local})
    plans = served.model_plans()
    served.routing_policy()
    assert {p.name for p in plans} == {m.name for m in config.models}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    hints = typing.get_type_hints(EngineConfig)
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for plan in plans:
        for d in plan.deployments:
            if d.spec.backend != "native":
                continue
            # weights come from the model volume
            assert any(d.spec.model_id.startswith(m + "/") for m in mounts), d.spec.model_id
            options = dict(d.spec.options)
            assert set(options) <= engine_fields - {"model", "served_model_name"}, options
            for name, value in options.items():  # the engine takes them as they are
                allowed = typing.get_args(hints[name]) or (hints[name],)
                allowed = tuple(a for a in allowed if isinstance(a, type))
                if float in allowed:
                    allowed += (int,)
                assert isinstance(value, allowed), (name, value, hints[name])
            EngineConfig(model=d.spec.model_id, served_model_name=d.spec.name, **options)


# ---- services, selectors, ports -----------------------------------------------------------

@pytest.mark.parametrize("service, workload", [
    ("switchyard", ("Deployment", "switchyard")),
    ("switchyard-redis", ("StatefulSet", "switchyard-redis")),
])
def test_services_select_their_pods_on_named_ports(
        docs: dict[tuple[str, str], Doc], service: str, workload: tuple[str, str]) -> None:
    svc = docs[("Service", service)]
    spec = docs[workload]["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for c in spec["template"]["spec"]["containers"]
             for p in c["ports"]}
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in ports or port["targetPort"] in ports.values()
    if workload[0] == "StatefulSet":
        assert spec["serviceName"] == service


def test_the_gateway_reaches_redis_through_its_service(
        docs: dict[tuple[str, str], Doc], container: Doc, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = _settings(docs, container, monkeypatch).redis_url
    match = re.fullmatch(r"redis://switchyard:([0-9a-f]{64})@([\w.-]+):(\d+)/\d+", url or "")
    assert match, url  # as the ACL user, with the password of the switchyard-redis Secret
    svc = docs[("Service", match.group(2))]
    assert int(match.group(3)) in {p["port"] for p in svc["spec"]["ports"]}


# ---- autoscaling --------------------------------------------------------------------------

def test_the_hpa_scales_the_gateway_on_an_exported_gauge(
        docs: dict[tuple[str, str], Doc], deployment: Doc, exposition: Exposition) -> None:
    hpa = docs[("HorizontalPodAutoscaler", "switchyard")]["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"], deployment["kind"], deployment["metadata"]["name"])
    assert hpa["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == "tgi_queue_size"
    assert exposition.types[name] == "gauge"
    assert name in exposition.series and "model" in exposition.labels[name]
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert _quantity(metric["pods"]["target"]["averageValue"]) > 0


def test_the_adapter_rule_serves_the_hpa_metric(docs: dict[tuple[str, str], Doc],
                                                exposition: Exposition) -> None:
    hpa = docs[("HorizontalPodAutoscaler", "switchyard")]["spec"]
    wanted = hpa["metrics"][0]["pods"]["metric"]["name"]
    (config,) = [d for d in _documents(ADAPTER_RULES) if d["kind"] == "ConfigMap"]
    rules = yaml.safe_load(config["data"]["config.yaml"])["rules"]
    served = []
    for rule in rules:
        (series,) = metric_names(rule["seriesQuery"])
        assert series in exposition.series, series
        overrides = rule["resources"]["overrides"]
        assert overrides["namespace"]["resource"] == "namespace"
        assert overrides["pod"]["resource"] == "pod"
        assert re.search(rule["name"]["matches"], series)
        exposed = re.sub(rule["name"]["matches"], rule["name"].get("as", ""), series) \
            if rule["name"].get("as") else series
        served.append(exposed)
        query = rule["metricsQuery"]
        assert "<<.Series>>" in query and "<<.LabelMatchers>>" in query
        assert "<<.GroupBy>>" in query  # per pod
    assert wanted in served
