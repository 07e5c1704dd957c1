"""Per-model sampling defaults: request > models file `defaults:` > --sampling-defaults >
the checkpoint's generation_config > neutral, observed in the SamplingParams a backend gets."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from backends.base import GenerationRequest, ModelInfo, SamplingDefaults
from gateway.app import create_app
from gateway.settings import ConfigError, Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.scripted_backend import ScriptedBackend

CHECKPOINT = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05)


@dataclass
class CheckpointBackend(ScriptedBackend):
    """A scripted backend whose checkpoint ships a generation_config (CHECKPOINT)."""

    own: SamplingDefaults = CHECKPOINT

    def info(self) -> ModelInfo:
        return replace(super().info(), sampling_defaults=self.own)


def _models_file(tmp_path: Path, models: list[dict[str, Any]]) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps({"models": models}))  # JSON is YAML
    return path


def _ask(url: str, model: str, **fields: Any) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
    assert answer.status_code == 200, answer.text


def _sampling(backend: ScriptedBackend) -> tuple[float, float, int, float, float]:
    s = backend.requests[-1].sampling
    return s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty


def test_a_request_without_sampling_gets_the_checkpoints(serve_app: ServeApp) -> None:
    backend = CheckpointBackend(["ok"])
    url = serve_app(create_app(Settings(), backends={"m": backend}))
    _ask(url, "m")
    assert _sampling(backend) == (0.6, 0.95, 20, 0.0, 1.05)
    _ask(url, "m", temperature=0, top_k=-1, top_p=1.0)  # the request's own values win
    assert _sampling(backend) == (0.0, 1.0, 0, 0.0, 1.05)
    completion = {"model": "m", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=completion).status_code == 200
    assert _sampling(backend) == (0.6, 0.95, 20, 0.0, 1.05)


def test_without_any_defaults_a_request_samples_neutrally(serve_app: ServeApp) -> None:
    backend = ScriptedBackend(["ok"])  # a remote model's case: nothing known, nothing invented
    url = serve_app(create_app(Settings(), backends={"m": backend}))
    _ask(url, "m")
    assert _sampling(backend) == (1.0, 1.0, 0, 0.0, 1.0)
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["sampling_defaults"] == {}


def test_models_file_over_flag_over_checkpoint(serve_app: ServeApp, tmp_path: Path) -> None:
    config = _models_file(tmp_path, [
        {"name": "filed", "model_id": "unused", "aliases": ["f"],
         "defaults": {"temperature": 0.3, "min_p": 0.05}},
        {"name": "flagged", "model_id": "unused"},
    ])
    settings = Settings(config_file=config,
                        sampling_defaults='{"temperature": 0.7, "top_p": 0.8}')
    filed, flagged = CheckpointBackend(["ok"]), CheckpointBackend(["ok"])
    url = serve_app(create_app(settings, backends={"filed": filed, "flagged": flagged}))
    _ask(url, "f")
    assert _sampling(filed) == (0.3, 0.8, 20, 0.05, 1.05)
    _ask(url, "flagged")
    assert _sampling(flagged) == (0.7, 0.8, 20, 0.0, 1.05)
    cards = {c["id"]: c["sampling_defaults"] for c in httpx.get(f"{url}/v1/models").json()["data"]}
    assert cards["f"] == cards["filed"] == {"temperature": 0.3, "top_p": 0.8, "top_k": 20,
                                            "min_p": 0.05, "repetition_penalty": 1.05}
    info = httpx.get(f"{url}/info", headers={"x-model": "flagged"}).json()
    assert info["sampling_defaults"]["temperature"] == 0.7


@pytest.mark.parametrize(("defaults", "message"), [
    ({"temperature": 5}, "models[0].defaults.temperature: Input should be less than or equal"),
    ({"temprature": 0.5}, "models[0].defaults.temprature: unknown field"),
    ({"top_p": 0}, "models[0].defaults.top_p: Input should be greater than 0"),
    ({"top_k": "5"}, "models[0].defaults.top_k: Input should be a valid integer"),
])
def test_bad_defaults_are_a_config_error(tmp_path: Path, defaults: dict[str, Any],
                                         message: str) -> None:
    config = _models_file(tmp_path, [{"name": "m", "model_id": "unused", "defaults": defaults}])
    with pytest.raises(ConfigError) as info:
        Settings(config_file=config).model_plans()
    assert message in str(info.value)


def test_the_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_SAMPLING_DEFAULTS", '{"temperature": 0.7, "top_k": -1}')
    assert Settings().flag_sampling() == SamplingDefaults(temperature=0.7, top_k=0)
    (plan,) = Settings().model_plans()
    assert plan.sampling_defaults == SamplingDefaults(temperature=0.7, top_k=0)
    for bad in ('{"temperature": 5}', '{"seed": 1}', "temperature=0.7"):
        with pytest.raises(ValidationError):
            Settings(sampling_defaults=bad)


def test_a_real_checkpoints_generation_config_reaches_the_engine(
        serve_app: ServeApp, tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    from backends.native.backend import NativeBackend
    from backends.native.config import EngineConfig

    folder = tmp_path / "model"
    shutil.copytree(tiny_model("llama_gqa"), folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(temperature=0.6, top_p=0.9, top_k=20, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    backend = NativeBackend(EngineConfig(model=str(folder), served_model_name="tiny",
                                         dtype="float32", max_total_tokens=64, compile=False))
    seen = _record(backend)
    url = serve_app(create_app(Settings(), backends={"tiny": backend}))
    _wait_ready(url)
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["sampling_defaults"] == expected
    assert httpx.get(f"{url}/info").json()["sampling_defaults"] == expected
    _ask(url, "tiny", max_tokens=2)
    s = seen[-1].sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.9, 20)


def _record(backend: Any) -> list[GenerationRequest]:
    """The requests `backend` is given from now on."""
    seen: list[GenerationRequest] = []
    generate = backend.generate

    def recording(req: GenerationRequest) -> Any:
        seen.append(req)
        return generate(req)

    backend.generate = recording
    return seen


def _wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.2)
