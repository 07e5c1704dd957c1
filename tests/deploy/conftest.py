"""The compose topology as local processes: Envoy -> two gateway replicas -> one Redis."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.auth.conftest import RedisServer
from tests.deploy.envoy_proxy import EnvoyProcess, upstream_names
from tests.deploy.gateways import GatewayProcess, free_port, write_models_file

ADMIN_KEY = "sy-admin-" + secrets.token_urlsafe(24)
MODELS = {"default": "llama_gqa", "second": "qwen2_bias_tied"}  # served name: tiny arch


@dataclass
class Topology:
    envoy: EnvoyProcess
    gateways: dict[str, GatewayProcess]  # by compose service name
    redis: RedisServer

    def create_key(self, **options: object) -> dict:
        """A key made through Envoy and a replica's admin API (secret in `key`)."""
        response = httpx.post(f"{self.envoy.url}/admin/keys", json=options, timeout=10,
                              headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert response.status_code == 201, response.text
        return response.json()


def _start(gateways: dict[str, GatewayProcess]) -> None:
    for gateway in gateways.values():
        gateway.start()
    for gateway in gateways.values():
        gateway.wait_ready()


@pytest.fixture(scope="session")
def topology(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[[str], Path],
) -> Iterator[Topology]:
    folder = tmp_path_factory.mktemp("deploy")
    redis = RedisServer(folder)
    redis.start()
    config_file = write_models_file(
        folder / "models.yaml", {name: tiny_model(arch) for name, arch in MODELS.items()})
    gateways = {name: GatewayProcess(name, folder, config_file, redis.url, ADMIN_KEY)
                for name in sorted(upstream_names())}  # gateway-1, gateway-2
    envoy: EnvoyProcess | None = None
    try:
        _start(gateways)
        ports = {name: gateway.port for name, gateway in gateways.items()}
        envoy = EnvoyProcess(folder, free_port(), free_port(), ports)
        envoy.start(healthy_hosts=len(gateways))
        envoy.wait_healthy("model_default", len(gateways))
        yield Topology(envoy, gateways, redis)
    finally:
        if envoy is not None:
            envoy.stop()
        for gateway in gateways.values():
            gateway.stop()
        redis.stop()
