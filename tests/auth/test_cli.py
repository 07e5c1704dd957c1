"""`switchyard keys create | list | revoke | usage`, through a gateway and straight on Redis."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from auth.keys import hash_key
from gateway.cli import main
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, RedisServer, Replica


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["keys", *argv])
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.delenv("SWITCHYARD_REDIS_URL", raising=False)


def test_keys_commands_through_a_gateway_and_on_redis(
    capsys: pytest.CaptureFixture[str], replicas: tuple[Replica, Replica],
    redis_server: RedisServer,
) -> None:
    a, b = replicas
    code, out, err = run(capsys, "create", "--url", a.url, "--name", "cli", "--rpm", "5",
                         "--models", "tiny,slow", "--expires-in", "1d")
    assert code == 0, err
    made = json.loads(out)
    assert made["key"].startswith("sk-sy-") and made["models"] == ["tiny", "slow"]
    assert "not shown again" in err

    code, out, _ = run(capsys, "list", "--url", b.url)
    assert code == 0 and made["id"] in out and made["key"] not in out
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = httpx.post(f"{b.url}/v1/chat/completions", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {made['key']}"})
    assert answer.status_code == 200

    code, out, _ = run(capsys, "usage", made["id"], "--redis-url", redis_server.url)
    assert code == 0 and json.loads(out)["data"][0]["requests"] == 1
    code, out, _ = run(capsys, "revoke", made["id"], "--redis-url", redis_server.url)
    assert code == 0 and json.loads(out)["deleted"] is True
    assert httpx.post(f"{a.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {made['key']}"}).status_code == 401

    code, _, err = run(capsys, "usage", made["id"], "--url", a.url)
    assert code == 1 and "404" in err
    code, _, err = run(capsys, "list", "--url", a.url, "--admin-key", "wrong")
    assert code == 1 and "401" in err


def test_unreachable_targets_fail_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "list", "--url", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach the gateway" in err
    code, _, err = run(capsys, "list", "--redis-url", "redis://127.0.0.1:9/0")
    assert code == 1 and "unreachable" in err


def test_offline_key_goes_into_the_config_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    code, out, _ = run(capsys, "create", "--offline", "--name", "ops", "--tpm", "1000",
                       "--budget", "50000", "--budget-period", "30d")
    assert code == 0
    secret = out.split("store it now): ")[1].split()[0]
    entries = yaml.safe_load(out.split("`keys:` list:\n", 1)[1])
    assert entries[0]["key_sha256"] == hash_key(secret) and secret not in yaml.safe_dump(entries)
    config = tmp_path / "switchyard.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": "m", "model_id": "x"}],
                                      "keys": entries}))
    declared = Settings(config_file=config).auth_config().keys[0]
    assert (declared.name, declared.tpm, declared.budget_period) == ("ops", 1000, 30 * 86400)
