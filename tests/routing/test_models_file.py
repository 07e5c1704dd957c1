"""The models file: deployments, weights, priorities, routing settings, and errors by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.settings import ConfigError, Settings
from routing import RoutingPolicy

GOOD = """
routing: {cooldown_after_failures: 2, cooldown_seconds: 5, health_check_interval: 1.5}
models:
  - name: chat
    aliases: [gpt-4o]
    deployments:
      - {backend: remote, base_url: "http://a:8000/v1", model: llama, api_key_env: A_KEY,
         weight: 3}
      - {backend: remote, name: backup, base_url: "http://b:8000/v1", model: llama,
         priority: 1, timeout: 30}
      - {backend: native, model_id: /m/tiny, max_batch_size: 4, kv_cache_memory: 1.5GiB,
         options: {block_size: 8}}
  - name: old-style
    model_id: /m/old
    options: {max_batch_size: 2}
"""


def _settings(tmp_path: Path, text: str, **flags: object) -> Settings:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return Settings(config_file=path, **flags)


def test_deployments_become_specs(tmp_path: Path) -> None:
    settings = _settings(tmp_path, GOOD, dtype="float32")
    chat, old = settings.model_plans()
    assert (chat.name, chat.aliases) == ("chat", ("gpt-4o",))
    a, backup, native = chat.deployments
    assert (a.name, a.weight, a.priority) == ("remote-0", 3.0, 0)
    assert a.spec.backend == "remote" and a.spec.name == "chat"
    assert a.spec.options == {"base_url": "http://a:8000/v1", "model": "llama",
                              "api_key_env": "A_KEY"}  # no engine flags for a remote
    assert (backup.name, backup.weight, backup.priority) == ("backup", 1.0, 1)
    assert backup.spec.options["timeout"] == 30
    assert (native.name, native.spec.model_id) == ("native-2", "/m/tiny")
    assert native.spec.options.items() >= {
        "dtype": "float32", "max_batch_size": 4, "block_size": 8,
        "kv_cache_memory": 1.5 * 1024**3}.items()
    (only,) = old.deployments
    assert (only.name, only.spec.model_id, only.spec.backend) == ("native-0", "/m/old", "native")
    assert only.spec.options.items() >= {"dtype": "float32", "max_batch_size": 2}.items()
    assert settings.routing_policy() == RoutingPolicy(
        cooldown_after_failures=2, cooldown_seconds=5, health_check_interval=1.5)
    assert [s.model_id for s in settings.model_specs()] == ["", "", "/m/tiny", "/m/old"]


def test_routing_defaults(tmp_path: Path) -> None:
    assert Settings().routing_policy() == RoutingPolicy()
    text = "models:\n  - {name: x, model_id: /m/x}\n"
    assert _settings(tmp_path, text).routing_policy() == RoutingPolicy(3, 30.0, 10.0)


@pytest.mark.parametrize(("body", "named"), [
    ("models:\n  - {name: x, model_id: /m, deployments: [{backend: native, model_id: /m}]}\n",
     "models[0]: give `model_id` or `deployments`, not both"),
    ("models:\n  - {name: x, deployments: []}\n", "models[0].deployments: List should have"),
    ("models:\n  - {name: x, deployments: [{backend: remote, weight: 0}]}\n",
     "models[0].deployments[0].weight: Input should be greater than 0"),
    ("models:\n  - {name: x, deployments: [{backend: remote, weight: heavy}]}\n",
     "models[0].deployments[0].weight"),
    ("models:\n  - {name: x, deployments: [{backend: remote, priority: 0.5}]}\n",
     "models[0].deployments[0].priority"),
    ("models:\n  - {name: x, model_id: /m, weight: 2}\n", "models[0].weight: unknown field"),
    ("models:\n  - {name: x, backend: remote, deployments: [{backend: remote}]}\n",
     "`backend` and `options` go in each deployment"),
    ("models:\n  - {name: x, deployments: [{backend: native, block_size: 8, "
     "options: {block_size: 16}}]}\n", "deployments[0]: ['block_size'] given both"),
    ("routing: {cooldown_seconds: 0}\nmodels:\n  - {name: x, model_id: /m}\n",
     "routing.cooldown_seconds: Input should be greater than 0"),
    ("routing: {cooldown: 1}\nmodels:\n  - {name: x, model_id: /m}\n",
     "routing.cooldown: unknown field"),
    ("modles: []\n", "modles: unknown field"),
    ("models: [\n", "not valid YAML"),
    ("models:\n  - {name: x, deployments: [{backend: native}]}\n",
     "a native deployment needs `model_id`"),
    ("models:\n  - {name: x, model_id: /m, options: {kv_cache_memory: lots}}\n",
     "model 'x': kv_cache_memory: not a memory size: 'lots'"),
])
def test_mistakes_name_the_field(tmp_path: Path, body: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _settings(tmp_path, body).model_plans()
    assert named in str(caught.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the models file"):
        Settings(config_file=tmp_path / "nope.yaml").model_plans()


@pytest.mark.parametrize(("body", "named"), [
    ("models:\n  - {name: x, deployments: [{backend: remote, wieght: 2}]}\n", "wieght"),
    ("models:\n  - {name: x, deployments: [{backend: carrier-pigeon}]}\n", "carrier-pigeon"),
    ("models:\n  - {name: x, deployments: [{backend: native, model_id: /m, turbo: 1}]}\n",
     "turbo"),
    ("models:\n  - {name: x, deployments: [{backend: remote, priority: 0.5}]}\n", "priority"),
    ("models:\n  - {name: x, deployments: [{backend: native, model_id: /m, name: a},\n"
     "    {backend: native, model_id: /m, name: a}]}\n", "unique"),
])
def test_the_cli_prints_the_mistake_and_exits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, named: str,
) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(body)
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--config-file", str(path)])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("switchyard: invalid configuration:") and named in err
    assert "Traceback" not in err
