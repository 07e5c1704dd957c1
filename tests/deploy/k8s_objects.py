"""deploy/k8s as a cluster would see it: `kubectl kustomize` output, the Secrets the user
creates with the commands deploy/README.md gives, and a container's environment as the
kubelet builds it (ConfigMaps, Secrets, then `$(VAR)` expansion)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
DEPLOY_README = REPO / "deploy" / "README.md"
Doc = dict[str, Any]
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _kubectl() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed")
    return binary


def kustomized() -> list[Doc]:
    """`kubectl kustomize deploy/k8s`: what `kubectl apply -k` would send to the cluster."""
    run = subprocess.run([_kubectl(), "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60, check=True)
    return [d for d in yaml.safe_load_all(run.stdout) if d is not None]


def secret_commands() -> list[str]:
    """The `kubectl ... create secret` commands of deploy/README.md, continuation lines
    joined."""
    commands, current = [], ""
    for line in DEPLOY_README.read_text().splitlines():
        if current or re.match(r"kubectl (-n \S+ )?create secret ", line):
            current += line.rstrip("\\").strip() + " "
            if not line.endswith("\\"):
                commands.append(current.strip())
                current = ""
    return commands


@cache
def user_secrets() -> dict[str, dict[str, str]]:
    """The Secrets the README's commands make (run with --dry-run=client): name -> data;
    made once per test session, like a cluster's."""
    _kubectl()
    out: dict[str, dict[str, str]] = {}
    for command in secret_commands():
        run = subprocess.run(["bash", "-c", f"{command} --dry-run=client -o yaml"],
                             capture_output=True, text=True, timeout=60, check=True)
        secret = yaml.safe_load(run.stdout)
        out[secret["metadata"]["name"]] = {
            k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    return out


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)`: a variable defined earlier, else the text as written."""
    return _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def environment(container: Doc, config_maps: dict[str, dict[str, str]],
                secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment, as the kubelet would set it."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]["secretKeyRef"]
        env[var["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def expanded_args(container: Doc, env: dict[str, str]) -> list[str]:
    return [expand(arg, env) for arg in container.get("args", [])]
