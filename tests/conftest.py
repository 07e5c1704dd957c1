"""Shared fixtures: tiny random models written with save_pretrained, the default GGUF, and
one real redis-server for the session."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.auth.conftest import RedisServer

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

ARCHITECTURES: dict[str, dict] = {
    "llama_gqa": {"model_type": "llama"},
    "llama3_rope": {
        "model_type": "llama",
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    },
    "qwen2_bias_tied": {"model_type": "qwen2", "tie_word_embeddings": True},
    "mistral_window": {"model_type": "mistral", "sliding_window": 12},
}


@pytest.fixture(scope="session", autouse=True)
def _single_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache_per_cpu_kind() -> None:
    """Tests' own torch.compile calls get a folder per CPU kind, as the engine's do:
    inductor's keys miss ATEN_CPU_CAPABILITY, and a run capped to AVX2 after an uncapped one
    reused 16-lane kernels (test_f32_linear's relu left half of each 16 unclamped)."""
    from backends.machine.cache_dir import point_inductor_cache
    from backends.machine.cpu_dtype import machine_key

    point_inductor_cache(None, machine_key())


@pytest.fixture(autouse=True)
def _no_stray_log_handlers() -> Iterator[None]:
    """A test that runs the CLI in-process installs a root stderr handler on pytest's captured
    stream, closed after the test: later tests' log lines would hit it ("Logging error")."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in root.handlers[:]:
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from backends.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, default_gguf_path: str) -> Path:
    """The default model's real tokenizer (with chat template) as a Hugging Face folder."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(default_gguf_path), gguf_file=os.path.basename(default_gguf_path)
    )
    tok.save_pretrained(folder)
    return folder


def write_tiny_model(folder: Path, tokenizer_dir: Path, arch: str, seed: int = 0) -> Path:
    """A random model of `arch` saved with save_pretrained, plus the shared tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHITECTURES[arch])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=49152, bos_token_id=1, eos_token_id=2, **TINY, **spec
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random biases, so a missed bias shows in the output
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, folder / item.name)
    return folder


@pytest.fixture(scope="session")
def tiny_model(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_model(tmp_path_factory.mktemp(arch), tokenizer_dir, arch)
        return cache[arch]

    return make


def pytest_collection_finish(session: pytest.Session) -> None:
    """llama.cpp's llama-quantize, where a collected test needs it, starts building now in
    the background (tests/llama_cpp_tools.py): ~10 minutes of the core the suite leaves idle."""
    from tests import llama_cpp_tools

    if any(item.nodeid.startswith(llama_cpp_tools.TESTS) for item in session.items):
        llama_cpp_tools.start_build()
