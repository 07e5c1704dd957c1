"""GET /info reports the dtype `--dtype auto` chose for the machine the test runs on, and why.

The expectation comes from the pure decision applied to this machine's facts, so the test
holds on an AVX-512-BF16 machine (bf16), an AVX2 one, or under ATEN_CPU_CAPABILITY=avx2 /
ONEDNN_MAX_CPU_ISA=AVX2 (float32).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from backends.machine.cpu_dtype import bf16_verdict, gather_cpu_facts
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server


def _backend(model: Path, name: str, dtype: str) -> NativeBackend:
    return NativeBackend(EngineConfig(
        model=str(model), served_model_name=name, dtype=dtype, max_total_tokens=128,
        max_batch_total_tokens=512, block_size=8, compile=False,
    ))


@pytest.fixture(scope="module")
def http(tiny_model: Callable[[str], Path]) -> Iterator[httpx.Client]:
    model = tiny_model("llama_gqa")
    backends = {"auto": _backend(model, "auto", "auto"),
                "fp32": _backend(model, "fp32", "float32")}
    app = create_app(Settings(model_id="unused"), backends=backends)
    with running_server(app, timeout_s=120) as url, \
            httpx.Client(base_url=url, timeout=30) as session:
        yield session


def test_info_reports_the_auto_dtype_of_this_machine(http: httpx.Client) -> None:
    native, why = bf16_verdict(gather_cpu_facts())
    info = http.get("/info", headers={"x-model": "auto"})
    assert info.status_code == 200
    body = info.json()
    if native is None:  # facts ambiguous here: a startup probe decided
        assert body["model_dtype"] in ("torch.bfloat16", "torch.float32")
        assert "probe" in body["dtype_reason"]
    else:
        expected = "torch.bfloat16" if native else "torch.float32"
        assert body["model_dtype"] == expected
        assert body["dtype_reason"] == f"auto: {why}"


def test_the_auto_model_generates(http: httpx.Client) -> None:
    # The chosen dtype must run end to end, not only be reported.
    response = http.post("/generate", headers={"x-model": "auto"},
                         json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200
    assert response.json()["generated_text"] != ""


def test_info_reports_an_explicit_dtype_as_explicit(http: httpx.Client) -> None:
    body = http.get("/info", headers={"x-model": "fp32"}).json()
    assert body["model_dtype"] == "torch.float32"
    assert body["dtype_reason"].startswith("explicit --dtype")
