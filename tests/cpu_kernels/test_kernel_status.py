"""Which CPU kernels run, as /info and the startup log report it (backends/cpu_kernels/
status.py): the variant or `none (<why>)`, a failed build logged as an error with the compiler's
message, and SWITCHYARD_CPU_KERNELS=required failing a model's load instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends.base import ModelInfo
from backends.cpu_kernels.build import VARIANTS, choose_variant, kernel_status
from backends.cpu_kernels.status import (
    BUILD_VARIANTS,
    SETTING,
    KernelStatus,
    KernelsUnavailable,
    compiler_message,
    loaded,
    read_setting,
    require,
    unavailable,
)
from backends.machine.cpu_dtype import read_cpuinfo
from gateway.tgi.info import info_body
from tests.quantized.helpers import make_engine

ROOT = Path(__file__).parents[2]
VNNI_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
GXX_STDERR = """\
In file included from /site/backends/cpu_kernels/int8_dot.cpp:12:
/site/backends/cpu_kernels/int8_dot.cpp:12:10: fatal error: simd.h: No such file or directory
   12 | #include "simd.h"
      |          ^~~~~~~~
compilation terminated.
"""


def _buildable_here() -> bool:
    _, flags = read_cpuinfo()
    return choose_variant(flags, torch.backends.cpu.get_cpu_capability(), "auto").variant \
        is not None


def test_the_setting_names_the_build_variants() -> None:
    assert tuple(VARIANTS) == BUILD_VARIANTS


@pytest.mark.parametrize(("flags", "capability", "setting", "reason"), [
    (VNNI_FLAGS, "AVX512", "off", f"off by {SETTING}=off"),
    (frozenset({"sse4_2"}), "DEFAULT", "auto", "this CPU lacks avx2 (no avx2, f16c, fma)"),
    (AVX2_FLAGS, "AVX2", "avx512-vnni", "this CPU lacks avx512-vnni (no avx512_vnni, avx512bw,"
                                         " avx512f, avx512vl)"),
    (VNNI_FLAGS, "DEFAULT", "required",
     "torch dispatches to DEFAULT code (ATEN_CPU_CAPABILITY), below avx2"),
    (None, "AVX512", "auto", "this CPU's instruction sets could not be read (/proc/cpuinfo)"),
])
def test_none_says_why(flags, capability, setting, reason) -> None:
    assert choose_variant(flags, capability, setting).variant is None
    assert choose_variant(flags, capability, setting).reason == reason


def test_required_chooses_as_auto_does() -> None:
    for flags, capability in ((VNNI_FLAGS, "AVX512"), (VNNI_FLAGS, "AVX2"), (AVX2_FLAGS, "AVX2")):
        assert choose_variant(flags, capability, "required") == \
            choose_variant(flags, capability, "auto")


def test_the_reported_names() -> None:
    assert loaded("avx512-vnni", bf16_built=True).describe() == "avx512-bf16"
    assert loaded("avx512-vnni", bf16_built=False).describe() == "avx512"
    assert loaded("avx2", bf16_built=False).describe() == "avx2"
    assert unavailable("off by X=off").describe() == "none (off by X=off)"


def test_the_setting_is_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SETTING, " Required ")
    assert read_setting() == "required"
    monkeypatch.setenv(SETTING, "avx9")
    with pytest.raises(ValueError, match=SETTING):
        read_setting()
    monkeypatch.delenv(SETTING)
    assert read_setting() == "auto"


def test_required_refuses_none_and_names_the_reason() -> None:
    none = unavailable("the CPU kernels could not be built: simd.h: No such file")
    with pytest.raises(KernelsUnavailable, match=r"^--cpu-kernels required .*: the CPU kernels "
                                                 r"could not be built: simd.h: No such file$"):
        require(none, "required")
    assert require(none, "auto") is none
    running = KernelStatus("avx2", "avx2")
    assert require(running, "required") is running


def test_the_compiler_message_is_its_last_meaningful_lines() -> None:
    assert compiler_message(GXX_STDERR) == ("/site/backends/cpu_kernels/int8_dot.cpp:12:10: "
                                            "fatal error: simd.h: No such file or directory")
    linker = ("/usr/bin/ld: cannot find -ltorch_cpu: No such file or directory\n"
              "collect2: error: ld returned 1 exit status\n")
    assert compiler_message(linker) == " / ".join(linker.strip().splitlines())
    notes = "a.cpp:3:5: error: no matching function\na.cpp:1:6: note: candidate: f(int)\n"
    assert compiler_message(notes) == "a.cpp:3:5: error: no matching function"
    assert compiler_message("") == "no message"


def test_info_reports_the_variant_beside_the_dtype() -> None:
    info = ModelInfo("m", 10, 20, "bfloat16", extra={"dtype_reason": "auto: native",
                                                     "cpu_kernels": "avx512-bf16"})
    body = info_body(info, version="0")
    keys = list(body)
    assert body["cpu_kernels"] == "avx512-bf16"
    assert keys.index("cpu_kernels") == keys.index("dtype_reason") + 1
    assert info_body(ModelInfo("m", 10, 20), version="0")["cpu_kernels"] is None


def test_a_loaded_model_reports_this_process_kernels(
        tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="backends.native.loading.model_setup"):
        engine = make_engine(tiny_model("llama_gqa"), dtype="float32")
    assert engine.loaded.cpu_kernels == kernel_status().describe()
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready: ")]
    assert ready and ready[-1].endswith(f", cpu_kernels: {kernel_status().describe()}")


def _load_with_a_broken_build(model: Path, tmp_path: Path, setting: str) -> \
        subprocess.CompletedProcess[str]:
    env = {**os.environ, SETTING: setting, "SWITCHYARD_CACHE_DIR": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tests.cpu_kernels.broken_build_check", str(model),
         str(tmp_path / "broken.cpp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.skipif(not _buildable_here(), reason="no kernel variant fits this CPU and torch")
def test_auto_logs_a_failed_build_as_an_error_and_falls_back(
        tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    done = _load_with_a_broken_build(tiny_model("llama_gqa"), tmp_path, "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cpu_kernels"].startswith("none (the CPU kernels could not be built: ")
    assert "undeclared_name" in result["cpu_kernels"]
    assert len(result["tokens"]) == 3  # torch's kernels ran the model
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "undeclared_name" in errors[0], done.stderr
    assert "cpu_kernels: none (the CPU kernels could not be built:" in errors[0]


@pytest.mark.skipif(not _buildable_here(), reason="no kernel variant fits this CPU and torch")
def test_required_fails_the_load_with_the_compiler_message(
        tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    done = _load_with_a_broken_build(tiny_model("llama_gqa"), tmp_path, "required")
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("load failed: --cpu-kernels required (SWITCHYARD_CPU_KERNELS="
                           "required): the CPU kernels could not be built: "), last
    assert "broken.cpp:1:" in last and "error:" in last and "undeclared_name" in last
