"""A second `switchyard serve` start of the default model reads the startup cache."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel_cache import seed_kernels
from tests.test_end_to_end import _free_port, _wait_ready

STAGES = ("checkpoint metadata", "weights", "tokenizer")


def _start(cache_dir: Path, log_file: Path) -> None:
    """Serve the default model until /health says 200, then stop it."""
    port = _free_port()
    env = {**os.environ, "SWITCHYARD_KV_CACHE_MEMORY": "64MiB",
           "SWITCHYARD_CACHE_DIR": str(cache_dir)}
    with open(log_file, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--model-id", "default",
             "--port", str(port), "--max-total-tokens", "512", "--num-threads", "1",
             "--compile", "false"],  # the compile cache is torch's; its cost is in bench/
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(f"http://127.0.0.1:{port}", process, timeout_s=300)
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)


def _stages(log_file: Path) -> dict[str, bool]:
    """Stage name -> whether the log says it was served from the cache."""
    found = re.findall(r"load: ([a-z -]+?) [0-9.]+s( \(cached\))?", log_file.read_text())
    return {name: bool(cached) for name, cached in found}


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cold then a warm start of the default model on one cache; their logs beside it."""
    folder = tmp_path_factory.mktemp("starts")
    seed_kernels(folder / "cache")  # the kernels' own cache is not what this checks
    _start(folder / "cache", folder / "cold.log")
    _start(folder / "cache", folder / "warm.log")
    return folder


def test_second_start_reads_the_cache_and_is_faster(started: Path) -> None:
    # How much faster the second start is, is measured in bench/startup.py, not asserted.
    cache_dir = started / "cache"
    cold_stages, warm_stages = _stages(started / "cold.log"), _stages(started / "warm.log")
    assert {s: cold_stages.get(s) for s in STAGES} == dict.fromkeys(STAGES, False)
    assert {s: warm_stages.get(s) for s in STAGES} == dict.fromkeys(STAGES, True)
    assert warm_stages.get("kv cache") is False  # allocated each start, logged all the same
    assert len(list(cache_dir.glob("models/*/weights-*/state.safetensors"))) == 1


def test_a_loaded_server_freezes_its_start_up_heap(started: Path) -> None:
    """Once the model is ready, what start-up left leaves the cyclic collector's reach (a
    full collection over it took ~0.3 s with the GIL held, stalling every stream)."""
    for name in ("cold.log", "warm.log"):
        text = (started / name).read_text()
        frozen = re.search(r"start-up heap frozen: (\d+) objects", text)
        assert frozen is not None and int(frozen.group(1)) > 100_000, text[-2000:]
        assert text.index("start-up heap frozen") > text.index(" ready in ")
