"""GPTQ (made by gptqmodel 7.6.0) and AWQ (made by autoawq) checkpoints of a tiny Llama,
through the native engine in bf16, against: transformers + gptqmodel loading the same folder
live, the reference library's 16 greedy tokens and logits recorded when the fixture was made
(tests/fixtures/quantized/make_*.py), and a plain dequantization of the same tensors run by
transformers."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from backends.quantized.int4_linear import Int4Linear
from backends.quantized.int8_linear import Int8Linear
from tests.quantized.helpers import (
    FIXTURES,
    LOGIT_TOLERANCE,
    assert_close_greedy,
    cached_greedy,
    dense_linear_bytes,
    fixture_folder,
    make_engine,
    native_greedy,
    quantized_linear_bytes,
    reference,
    teacher_forced_logits,
)
from tests.quantized.reference_dequant import awq_dense, dense_model, gptq_dense

GPTQ = sorted(p.name for p in FIXTURES.glob("gptq-*"))
AWQ = sorted(p.name for p in FIXTURES.glob("awq-*"))


def _dequantizer(name: str):
    qc = json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]
    if name.startswith("gptq"):
        # gptqmodel writes a quantized lm_head's own layout as a literal "lm_head" rule
        head_bits = (qc.get("dynamic") or {}).get("lm_head", {}).get("bits", qc["bits"])
        return lambda t, prefix: gptq_dense(
            t, prefix, bits=head_bits if prefix == "lm_head" else qc["bits"]
        )
    return partial(awq_dense, group=qc.get("group_size", qc.get("q_group_size")))


@pytest.fixture(scope="module", params=GPTQ + AWQ)
def case(request, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    folder = fixture_folder(name, tokenizer_dir, tmp_path_factory.mktemp("q"))
    engine = make_engine(folder)
    ref = reference(name)
    tokens, logits = native_greedy(engine, ref["prompt"].tolist())
    return name, folder, engine, ref, tokens, logits


def test_fixture_set_is_complete() -> None:
    assert len(GPTQ) == 7 and len(AWQ) == 3


def test_matches_transformers_and_gptqmodel_live(case) -> None:
    """gptqmodel's plain torch kernels, as the fixtures were recorded with: its CPU auto
    choice for per-channel asymmetric 4-bit (TorchFusedLinear, 7.6.0) decodes other tokens
    than its own torch kernel, the recording, the native engine and a plain dequantization."""
    pytest.importorskip("gptqmodel")
    name, folder, _, ref, tokens, logits = case
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    model = (_gptqmodel_loaded(folder) if qc.get("lm_head")
             else _transformers_loaded(folder, name, qc["bits"]))
    assert any("gptqmodel" in type(m).__module__ for m in model.modules()), name
    assert "gptqmodel" in type(model.lm_head).__module__ or not qc.get("lm_head")
    want_tokens, want_logits = cached_greedy(model, ref["prompt"].tolist())
    assert_close_greedy(tokens, logits, want_tokens, want_logits)


def _transformers_loaded(folder: Path, name: str, bits: int):
    from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

    kernel = (GPTQConfig(bits=bits, backend="torch") if name.startswith("gptq")
              else AwqConfig(bits=bits, backend="torch_awq"))
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, device_map="cpu", quantization_config=kernel
    ).eval()


def _gptqmodel_loaded(folder: Path):
    """gptqmodel's own loader: transformers 5.24 leaves a quantized lm_head unloaded (random)."""
    from gptqmodel import BACKEND, GPTQModel

    return GPTQModel.load(str(folder), backend=BACKEND.TORCH, device="cpu",
                          dtype=torch.bfloat16).model.eval()


def test_matches_reference_library_recorded(case) -> None:
    _, _, _, ref, tokens, logits = case
    assert_close_greedy(tokens, logits, ref["tokens"].tolist(), ref["logits"])


def test_matches_live_reference_dequantization(case) -> None:
    name, folder, _, ref, tokens, logits = case
    model = dense_model(folder, _dequantizer(name))
    want = teacher_forced_logits(model, ref["prompt"].tolist(), tokens)
    assert want.argmax(-1).tolist() == tokens
    diff = (logits - want).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"{name}: {diff:.4f}"


def test_weights_stay_packed(case) -> None:
    name, _, engine, *_ = case
    layer = engine.loaded.model.model.layers[0]
    kinds = {type(m) for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj)}
    assert kinds <= {Int4Linear, Int8Linear}, kinds
    if "actorder" in name and "channel" not in name:  # act order kept as a column order
        assert any(getattr(m, "perm", None) is not None for m in engine.loaded.model.modules())
    assert engine.loaded.quantization.startswith(name.split("-")[0])


def test_4bit_linears_take_at_most_035x_bf16(case) -> None:
    name, _, engine, *_ = case
    if "-w4-" not in name:
        pytest.skip("8-bit")
    ratio = quantized_linear_bytes(engine) / dense_linear_bytes(engine.loaded.hf_config)
    assert ratio <= 0.35, f"{name}: {ratio:.3f}"


def test_dequantize_path_agrees_with_kernel_path(case) -> None:
    """A 160-token prompt prefilled at once (dequantize + matmul, >= DENSE_MIN_ROWS rows) and in
    chunks of 8 (the int4 / int8 kernels) gives the same greedy tokens and close logits."""
    _, folder, _, ref, _, _ = case
    prompt = (ref["prompt"].tolist() * 14)[:160]
    whole = native_greedy(make_engine(folder, max_total_tokens=256), prompt, steps=4)
    chunked = native_greedy(
        make_engine(folder, max_total_tokens=256, max_batch_prefill_tokens=8), prompt, steps=4
    )
    assert_close_greedy(*whole, *chunked)
