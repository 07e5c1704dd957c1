"""Phi-3-mini's shape (every head dim rotated) on the decode step's C++ layers: its layers are
Llama's own once its fused q/k/v and gate/up are loaded, and its LongRoPE is all in the cos /
sin the step hands the layers, per position. Past `original_max_position_embeddings` (the
long factors), the bf16 engine decodes through the fused layers with the compiled layer
region's tokens and logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.cpu_kernels.build import bf16_linear_built
from backends.native.llm_engine import LLMEngine
from backends.native.models.llama import LlamaDecoderLayer
from backends.native.runner.fused_decode_layers import Bf16DecodeLayers
from tests.native.models.test_phi3 import THRESHOLD, phi3_config
from tests.native.models.test_qwen3_fused import BF16_LOGIT_TOLERANCE, BLOCK, fused_against_region
from tests.native.models.tiny import write_tiny
from tests.quantized.helpers import make_engine


def _built() -> bool:  # bf16_linear_built() loads our kernels first
    return bf16_linear_built() and bool(torch.ops.switchyard_cpu.bf16_decode_layers_built())


pytestmark = pytest.mark.skipif(
    not _built(), reason="this CPU has no AVX-512-BF16 (or our kernels are off)")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LLMEngine:
    folder = write_tiny(tmp_path_factory.mktemp("phi3-fused"), tokenizer_dir,
                        phi3_config(partial=1.0, sliding_window=None))
    return make_engine(folder, compile=True, block_size=BLOCK, max_total_tokens=128)


def test_full_rotary_phi3_decodes_through_the_fused_layers_past_the_threshold(
    engine: LLMEngine,
) -> None:
    assert type(engine.runner.model.model.layers[0]) is LlamaDecoderLayer
    assert isinstance(engine.runner.decode_step.fused_layers, Bf16DecodeLayers)
    prompt = list(range(300, 300 + THRESHOLD + 6))  # every decode position takes long factors
    tokens, region_tokens, worst = fused_against_region(engine, prompt)
    assert tokens == region_tokens
    assert worst <= BF16_LOGIT_TOLERANCE
