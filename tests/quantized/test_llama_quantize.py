"""GGUF files made by llama.cpp's own `llama-quantize` (tests/llama_cpp_tools.py builds it):
a tiny random Llama written in float32 and quantized to Q4_K_M, Q5_K_M and Q6_K with
llama.cpp's own type mixes. Each loads with every quantized tensor kept packed, in at most
1.1x the file's tensor bytes, and its greedy logits stay within tolerance of the same file
dequantized by the gguf package."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader

from backends.quantized.gguf import gguf_formats
from tests import llama_cpp_tools
from tests.quantized.gguf_files import dequantized_copy, tensor_bytes, write_tiny_gguf
from tests.quantized.helpers import make_engine
from tests.quantized.test_kquants import (
    BYTES_BUDGET,
    assert_greedy_close_to_dense,
    needs_kernel,
)

T = GGMLQuantizationType
FLOAT_TYPES = {T.F32, T.F16, T.BF16}
# llama-quantize's mixes: the types each file should hold (llama.cpp's choice per tensor).
MIX_TYPES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}}
# Max |logit - dequantized copy's logit|, float32, logits up to 1.6 (see
# assert_greedy_close_to_dense): measured Q5_K_M 1.9e-4, Q6_K 1.7e-4 (about 5x that allowed);
# Q4_K_M 5.1e-3 (3x allowed), at every row count: its Q4_K tensors run the int4 kernel, whose
# float16 scales and zeros round Q4_K's d x sc and dmin x m (6-bit factors on a float16: up to
# 17 significant bits). Q4_0 / Q4_1 files there, whose scales are float16 already, measured
# 4-6e-4. On our own random Q4_K blocks (test_kquants) the rounding stays under 3e-4.
MODEL_TOLERANCE = {"Q4_K_M": 1.5e-2, "Q5_K_M": 1e-3, "Q6_K": 1e-3}
BUILD_TIMEOUT_S = 1800  # a cold build on one core of a busy 2-core machine


@pytest.fixture(scope="module")
def llama_quantize() -> Path:
    return llama_cpp_tools.wait_for_build(BUILD_TIMEOUT_S)


@pytest.fixture(scope="module", params=sorted(MIX_TYPES))
def quantized(request, llama_quantize: Path, tmp_path_factory,
              default_gguf_path: str) -> tuple[str, Path, Path]:
    mix = request.param
    folder = tmp_path_factory.mktemp(f"llama-quantize-{mix}")
    source = write_tiny_gguf(folder / "f32.gguf", default_gguf_path, lambda stem: T.F32,
                             embed_type=T.F32)
    path = folder / f"{mix}.gguf"
    subprocess.run([str(llama_quantize), str(source), str(path), mix], check=True,
                   capture_output=True)
    return mix, path, dequantized_copy(path, folder / f"{mix}-f32.gguf")


def _quantized_types(path: Path) -> set[str]:
    return {T(tensor.tensor_type).name for tensor in GGUFReader(path).tensors
            if T(tensor.tensor_type) not in FLOAT_TYPES}


def test_files_load_packed_and_match_their_dequantized_copy(quantized) -> None:
    needs_kernel()
    mix, path, dense_path = quantized
    assert _quantized_types(path) == MIX_TYPES[mix]
    kept = make_engine(path, dtype="float32", max_total_tokens=256)
    dense = make_engine(dense_path, dtype="float32", max_total_tokens=256)
    formats = gguf_formats(kept.loaded.model)
    assert formats.expanded == [], formats.expanded
    assert set(formats.kept) == MIX_TYPES[mix]
    ratio = kept.loaded.weight_bytes / tensor_bytes(path)
    assert ratio <= BYTES_BUDGET, ratio
    assert_greedy_close_to_dense(kept, dense, MODEL_TOLERANCE[mix], mix)
