"""A model's task from the flags and the models file, down to its backend's spec; the
mistakes are refused at startup, naming the model or the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from backends.registry import BackendSpec, create_backend
from gateway.cli import build_parser
from gateway.settings import ConfigError, Settings


def _models_file(tmp_path: Path, *models: dict) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": list(models)}))
    return path


def test_the_task_flag_reaches_the_one_models_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["serve", "--model-id", "/m", "--task", "embed"])
    assert args.task == "embed"
    plan = Settings(model_id="/m", task="embed").model_plans()[0]
    assert plan.task == "embed" and plan.deployments[0].spec.task == "embed"
    monkeypatch.setenv("SWITCHYARD_TASK", "EMBED")
    assert Settings().task == "embed"
    assert Settings().model_plans()[0].task == "embed"
    with pytest.raises(ValidationError, match="'generate' or 'embed'"):
        Settings(task="rank")


def test_the_models_file_sets_each_models_task(tmp_path: Path) -> None:
    config = _models_file(
        tmp_path, {"name": "chat", "model_id": "/a"},
        {"name": "vectors", "task": "embed", "deployments": [
            {"backend": "native", "model_id": "/b"},
            {"backend": "remote", "base_url": "http://127.0.0.1:9/v1"}]})
    plans = {p.name: p for p in Settings(config_file=config).model_plans()}
    assert plans["chat"].task == "generate"
    assert plans["vectors"].task == "embed"
    assert {d.spec.task for d in plans["vectors"].deployments} == {"embed"}


def test_embed_on_tgi_and_unknown_tasks_are_refused(tmp_path: Path) -> None:
    tgi = _models_file(tmp_path, {"name": "vectors", "task": "embed", "backend": "tgi",
                                  "model_id": "x", "options": {"base_url": "http://h/"}})
    with pytest.raises(ConfigError, match="'vectors': task embed cannot run on the tgi"):
        Settings(config_file=tgi).model_plans()
    wrong = _models_file(tmp_path, {"name": "m", "model_id": "/a", "task": "rerank"})
    with pytest.raises(ConfigError, match=r"models\[0\]\.task"):
        Settings(config_file=wrong).model_plans()
    with pytest.raises(ValueError, match="tgi backend serves text generation only"):
        create_backend(BackendSpec(name="v", model_id="x", backend="tgi", task="embed",
                                   options={"base_url": "http://h/"}))
