"""deploy/prometheus-scrape.yaml: the shipped scrape jobs reach every gateway's /metrics
directly (never through Envoy, which answers 404 there, nor a Service, which would hand
each scrape to any pod). The Kubernetes job, run through Prometheus's relabelling over the
target kubernetes_sd makes of a gateway pod, scrapes the pod's own port and path, with the
`namespace` and `pod` labels the HPA's adapter rule groups by, and drops the Redis pod; the
compose job names exactly the gateway services, at the port they expose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.deploy.compose import compose_services
from tests.deploy.prometheus_relabel import annotation_label, relabel

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
Doc = dict[str, Any]
POD_IP = "10.1.2.3"


def _job(name: str) -> Doc:
    jobs = yaml.safe_load((REPO / "deploy" / "prometheus-scrape.yaml").read_text())
    (job,) = [j for j in jobs["scrape_configs"] if j["job_name"] == name]
    return job


def _workload(file: str, kind: str) -> Doc:
    (doc,) = [d for d in yaml.safe_load_all((K8S / file).read_text()) if d and d["kind"] == kind]
    return doc


def _pod_targets(workload: Doc, namespace: str) -> list[dict[str, str]]:
    """What kubernetes_sd (role: pod) discovers for one of `workload`'s pods: a target per
    declared container port, with the pod's annotations as meta labels."""
    template = workload["spec"]["template"]
    meta = {annotation_label(k): str(v)
            for k, v in (template["metadata"].get("annotations") or {}).items()}
    meta |= {"__meta_kubernetes_namespace": namespace,
             "__meta_kubernetes_pod_name": workload["metadata"]["name"] + "-0",
             "__metrics_path__": "/metrics", "__scheme__": "http"}
    return [{**meta, "__address__": f"{POD_IP}:{port['containerPort']}"}
            for c in template["spec"]["containers"] for port in c.get("ports", [])]


def test_the_kubernetes_job_scrapes_each_gateway_pod_directly() -> None:
    job = _job("switchyard")
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [namespace]
    gateway = _workload("deployment.yaml", "Deployment")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    kept = [t for t in (relabel(target, job["relabel_configs"])
                        for target in _pod_targets(gateway, namespace)) if t is not None]
    assert kept, "the gateway pod is not scraped"
    (port,) = container["ports"]
    for target in kept:
        assert target["__address__"] == f"{POD_IP}:{port['containerPort']}"
        assert target["__metrics_path__"] == annotations["prometheus.io/path"] == "/metrics"
        assert (target["namespace"], target["pod"]) == (namespace, "switchyard-0")
    redis = _workload("redis.yaml", "StatefulSet")
    assert all(relabel(t, job["relabel_configs"]) is None
               for t in _pod_targets(redis, namespace))


def test_the_compose_job_scrapes_each_gateway_service() -> None:
    services = compose_services()
    gateways = {name for name, s in services.items() if "serve" in (s.get("command") or [])}
    assert gateways == {"gateway-1", "gateway-2"}
    (static,) = _job("switchyard-compose")["static_configs"]
    by_host = dict(t.split(":") for t in static["targets"])
    assert set(by_host) == gateways  # never envoy: it answers 404 to /metrics
    for name, port in by_host.items():
        assert port in [str(p) for p in services[name]["expose"]], name
        command = services[name]["command"]
        assert command[command.index("--port") + 1] == port, name
        env = services[name].get("environment") or {}
        # Prometheus has no key: /metrics must be open on the compose network
        assert env.get("SWITCHYARD_METRICS_AUTH", "open") == "open", name
