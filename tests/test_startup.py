"""A second `switchyard serve` start of the default model reads the startup cache."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

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


def test_second_start_reads_the_cache_and_is_faster(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    # How much faster the second start is, is measured in bench/startup.py, not asserted.
    _start(cache_dir, tmp_path / "cold.log")
    _start(cache_dir, tmp_path / "warm.log")
    cold_stages, warm_stages = _stages(tmp_path / "cold.log"), _stages(tmp_path / "warm.log")
    assert {s: cold_stages.get(s) for s in STAGES} == dict.fromkeys(STAGES, False)
    assert {s: warm_stages.get(s) for s in STAGES} == dict.fromkeys(STAGES, True)
    assert warm_stages.get("kv cache") is False  # allocated each start, logged all the same
    assert len(list(cache_dir.glob("models/*/weights-*/state.safetensors"))) == 1
