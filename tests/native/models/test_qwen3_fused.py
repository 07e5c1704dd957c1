"""Qwen3 on the decode step's C++ layers (`fused_decode_layers.py` with `qk_norm`: an RMSNorm
over each head of q and of k before the rotary): float32 with all-Q4_0 linears from a GGUF
file (`q4_decode_layers`) and bf16 on our bf16 kernel (`bf16_decode_layers`). Each gives the
model's own layers' hidden states and cache writes, and the compiled engine decodes through it
with the compiled layer region's tokens and logits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from gguf.quants import quantize
from safetensors.torch import load_file

from backends.cpu_kernels.build import active_variant, bf16_linear_built
from backends.native.layers.attention import DecodeMetadata
from backends.native.llm_engine import LLMEngine
from backends.native.models.qwen3 import Qwen3DecoderLayer
from backends.native.runner.compiled_step import _embed
from backends.native.runner.fused_decode_layers import Bf16DecodeLayers, FusedDecodeLayers
from tests.native.models.test_qwen3 import _norms_off_one, qwen3_config
from tests.native.models.tiny import gguf_writer, write_tiny
from tests.native.runner.fused_layer_checks import counted_fused_calls, decode_rows, random_caches
from tests.quantized.helpers import make_engine, native_greedy

pytestmark = pytest.mark.skipif(active_variant() is None, reason="our CPU kernels are not built")

T = gguf.GGMLQuantizationType
BLOCK = 4
PROMPT = list(range(300, 318))
# float32 + Q4_0: the fused layers against the layers one by one (hidden states up to ~4,
# random N(0, 1) caches). test_fused_decode_layers.py's bound and reasons: q4_mm quantizes its
# input to int8, so a last-ulp change of an input (a norm's sum in another order) moves a
# product by up to ~3e-5 of its block's largest value, amplified through attention and the MLP.
# A missed, swapped or wrong q / k norm is off by the values' own size.
Q4_HIDDEN_TOLERANCE = 1e-2
# bf16: test_bf16_decode_layers.py's bound, four bf16 ulps of the largest value; the first
# layer's K (no attention before it) two.
BF16_RELATIVE_TOLERANCE = 2 ** -6
BF16_FIRST_K_TOLERANCE = 2 ** -7
# The fused engine's decode logits against the same engine on the compiled layer region.
Q4_LOGIT_TOLERANCE = 1e-3
BF16_LOGIT_TOLERANCE = 0.02


def write_qwen3_q4_gguf(path: Path, folder: Path, tokenizer_gguf: str) -> Path:
    """`folder`'s weights under llama.cpp's qwen3 names, its linears Q4_0 and its embedding
    Q8_0 (quantized by the gguf package), norms float32."""
    config = transformers.AutoConfig.from_pretrained(folder)
    writer = gguf_writer(path, gguf.MODEL_ARCH.QWEN3, config, tokenizer_gguf)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        values = tensor.float().numpy()
        qtype = (T.Q4_0 if name.endswith("_proj.weight")
                 else T.Q8_0 if name.endswith("embed_tokens.weight") else None)
        if qtype is None:
            writer.add_tensor(gguf_name, values)
        else:
            writer.add_tensor(gguf_name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_tiny(tmp_path_factory.mktemp("qwen3-fused"), tokenizer_dir, qwen3_config(),
                      tweak=_norms_off_one)


@pytest.fixture(scope="module")
def q4_engine(tmp_path_factory: pytest.TempPathFactory, folder: Path,
              default_gguf_path: str) -> LLMEngine:
    path = write_qwen3_q4_gguf(tmp_path_factory.mktemp("qwen3-q4") / "tiny-qwen3-q4_0.gguf",
                               folder, default_gguf_path)
    return make_engine(path, dtype="float32", compile=True, block_size=BLOCK,
                       max_total_tokens=64)


@pytest.fixture(scope="module")
def bf16_engine(folder: Path) -> LLMEngine:
    if not bf16_linear_built() or not torch.ops.switchyard_cpu.bf16_decode_layers_built():
        pytest.skip("this CPU has no AVX-512-BF16")
    return make_engine(folder, compile=True, block_size=BLOCK, max_total_tokens=64)


@dataclass
class LayerOutputs:
    """One decode step's layers over the same random caches: fused, and one by one."""

    got: torch.Tensor
    want: torch.Tensor
    x: torch.Tensor
    got_k: list[torch.Tensor]
    want_k: list[torch.Tensor]
    got_v: list[torch.Tensor]
    want_v: list[torch.Tensor]
    slots: tuple[list[int], list[int]]


def run_both(engine: LLMEngine, positions: list[int]) -> LayerOutputs:
    model, fused = engine.runner.model, engine.runner.decode_step.fused_layers
    tables = [[5, 2, 9, 0], [1, 7, 3, 11], [8, 4, 0, 0]][: len(positions)]
    rows = decode_rows(positions, tables, BLOCK)
    with torch.inference_mode():
        x, cos, sin, slot_blocks, slot_offsets, mask = _embed(model, rows, BLOCK, False)
        meta = DecodeMetadata(slot_blocks, slot_offsets, rows[:, 4:], mask)
        want_k, want_v = random_caches(engine.runner.kv_cache, seed=1)
        want = x
        for layer, k, v in zip(model.model.layers, want_k, want_v, strict=True):
            want = layer(want, cos, sin, k, v, meta)
        got_k, got_v = random_caches(engine.runner.kv_cache, seed=1)
        fused.k_caches, fused.v_caches = got_k, got_v
        try:
            got = fused(x, cos, sin, meta)
        finally:
            cache = engine.runner.kv_cache
            fused.k_caches, fused.v_caches = list(cache.k), list(cache.v)
    slots = (slot_blocks.tolist(), slot_offsets.tolist())
    return LayerOutputs(got, want, x, got_k, want_k, got_v, want_v, slots)


@contextmanager
def compiled_region(engine: LLMEngine) -> Iterator[None]:
    """The engine's decode step on its compiled layer region, the fused layers set aside."""
    step = engine.runner.decode_step
    fused, step.fused_layers = step.fused_layers, None
    try:
        yield
    finally:
        step.fused_layers = fused


def fused_against_region(
    engine: LLMEngine, prompt: list[int] = PROMPT,
) -> tuple[list[int], list[int], float]:
    """Greedy tokens through the fused layers (each decode step's call counted) and through
    the compiled region, and the largest logit difference."""
    with counted_fused_calls(engine.runner.decode_step) as calls:
        tokens, logits = native_greedy(engine, prompt, steps=4)
    assert calls == [1, 1, 1]  # the three decode steps after the prompt's
    with compiled_region(engine):
        region_tokens, region_logits = native_greedy(engine, prompt, steps=4)
    return tokens, region_tokens, (logits - region_logits).abs().max().item()


def test_q4_qwen3_is_covered_with_its_qk_norms(q4_engine: LLMEngine) -> None:
    layer = q4_engine.runner.model.model.layers[0]
    assert type(layer) is Qwen3DecoderLayer
    fused = q4_engine.runner.decode_step.fused_layers
    assert isinstance(fused, FusedDecodeLayers) and fused.qk_norm
    assert len(fused.weights) == 12 * len(q4_engine.runner.model.model.layers)


@pytest.mark.parametrize("positions", [[6], [6, 13, 2]])
def test_q4_fused_layers_match_the_layers_one_by_one(
    q4_engine: LLMEngine, positions: list[int],
) -> None:
    out = run_both(q4_engine, positions)
    assert out.got.shape == out.want.shape
    assert (out.got - out.want).abs().max().item() <= Q4_HIDDEN_TOLERANCE
    assert out.want.abs().max().item() > 0.5  # the layers did something
    layers = len(out.got_k)
    pairs = zip(out.got_k + out.got_v, out.want_k + out.want_v, strict=True)
    for i, (got_cache, want_cache) in enumerate(pairs):
        tolerance = 1e-5 if i % layers == 0 else Q4_HIDDEN_TOLERANCE  # first layer: rounding
        assert (got_cache - want_cache).abs().max().item() <= tolerance


def test_q4_engine_decodes_through_the_fused_layers_as_the_region(q4_engine: LLMEngine) -> None:
    tokens, region_tokens, worst = fused_against_region(q4_engine)
    assert tokens == region_tokens
    assert worst <= Q4_LOGIT_TOLERANCE


def test_bf16_qwen3_is_covered_with_its_qk_norms(bf16_engine: LLMEngine) -> None:
    fused = bf16_engine.runner.decode_step.fused_layers
    assert isinstance(fused, Bf16DecodeLayers) and fused.qk_norm
    assert len(fused.weights) == 8 * len(bf16_engine.runner.model.model.layers)


@pytest.mark.parametrize("positions", [[6], [6, 13, 2]])
def test_bf16_fused_layers_match_the_layers_one_by_one(
    bf16_engine: LLMEngine, positions: list[int],
) -> None:
    out = run_both(bf16_engine, positions)
    assert out.got.shape == out.want.shape and out.got.dtype == torch.bfloat16
    largest = out.want.abs().max().item()
    assert (out.got.float() - out.want.float()).abs().max().item() <= \
        BF16_RELATIVE_TOLERANCE * largest
    assert not torch.equal(out.want, out.x)  # the layers did something
    blocks, offsets = out.slots
    for got_cache, want_cache in zip(out.got_k + out.got_v, out.want_k + out.want_v,
                                     strict=True):
        got_rows, want_rows = (c[blocks, :, offsets].float() for c in (got_cache, want_cache))
        assert (got_rows - want_rows).abs().max().item() <= \
            BF16_RELATIVE_TOLERANCE * want_rows.abs().max().item()
    first_k = (out.got_k[0].float() - out.want_k[0].float()).abs()
    largest_k = out.want_k[0][blocks, :, offsets].abs().max().item()
    assert first_k.max().item() <= BF16_FIRST_K_TOLERANCE * largest_k


def test_bf16_engine_decodes_through_the_fused_layers_as_the_region(
    bf16_engine: LLMEngine,
) -> None:
    tokens, region_tokens, worst = fused_against_region(bf16_engine)
    assert tokens == region_tokens
    assert worst <= BF16_LOGIT_TOLERANCE
