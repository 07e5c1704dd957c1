"""Responses API fixtures: a tiny random Llama (tests/conftest.py) served by real uvicorn
servers, each with its own native engine, driven by the openai SDK."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server

MODEL = "tiny-llama"
Serve = Callable[[Settings], AbstractContextManager[str]]


@pytest.fixture(scope="session")
def model_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


def native(folder: Path) -> NativeBackend:
    return NativeBackend(EngineConfig(
        model=str(folder), served_model_name=MODEL, dtype="float32", max_total_tokens=512,
        max_batch_total_tokens=8192, block_size=8, compile=False))


@pytest.fixture(scope="session")
def serve(model_dir: Path) -> Serve:
    """`with serve(settings) as url`: a gateway serving the tiny model, stopped at the end."""
    @contextmanager
    def serving(settings: Settings) -> Iterator[str]:
        app = create_app(settings, backends={MODEL: native(model_dir)})
        with running_server(app, timeout_s=300) as url:
            yield url
    return serving


def sdk(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def new_key(url: str, admin_key: str, name: str) -> str:
    """An ordinary API key, made with the admin API."""
    response = httpx.post(f"{url}/admin/keys", json={"name": name},
                          headers={"Authorization": f"Bearer {admin_key}"}, timeout=10)
    assert response.status_code == 201, response.text
    return str(response.json()["key"])
