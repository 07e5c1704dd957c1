"""Malformed quantized checkpoints fail at load with a message naming the tensor or field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backends.quantized.config import QuantizationError
from tests.quantized.helpers import fixture_folder, make_engine

GPTQ = "gptq-w4-g64-sym"
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def gptq(tokenizer_dir: Path, tmp_path: Path) -> Path:
    return fixture_folder(GPTQ, tokenizer_dir, tmp_path)


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


def _fails(folder: Path, *fragments: str, **engine) -> None:
    with pytest.raises(QuantizationError) as info:
        make_engine(folder, **engine)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_missing_scales(gptq: Path) -> None:
    _edit_tensors(gptq, lambda t: t.pop(f"{Q}.scales"))
    _fails(gptq, f"{Q}.scales", "lacks")


def test_wrong_qweight_shape(gptq: Path) -> None:
    _edit_tensors(gptq, lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"][:-1].clone()}))
    _fails(gptq, f"{Q}.qweight", "shape")


def test_wrong_scales_shape(gptq: Path) -> None:
    _edit_tensors(gptq, lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"].t().contiguous()}))
    _fails(gptq, f"{Q}.scales", "shape")


def test_wrong_qweight_dtype(gptq: Path) -> None:
    _edit_tensors(gptq, lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].float()}))
    _fails(gptq, f"{Q}.qweight", "dtype")


def test_g_idx_out_of_range(gptq: Path) -> None:
    _edit_tensors(gptq, lambda t: t.update({f"{Q}.g_idx": t[f"{Q}.g_idx"] + 100}))
    _fails(gptq, f"{Q}.g_idx")


def test_dense_weight_in_a_gptq_checkpoint(gptq: Path) -> None:
    _edit_tensors(gptq, lambda t: t.update({f"{Q}.weight": torch.zeros(128, 128)}))
    _fails(gptq, f"{Q}.weight", "gptq")


def test_unknown_quant_method(gptq: Path) -> None:
    _edit_config(gptq, quant_method="hqq")
    _fails(gptq, "quant_method", "'hqq'")


def test_unsupported_bits(gptq: Path) -> None:
    _edit_config(gptq, bits=3)
    _fails(gptq, "quantization_config.bits=3")


def test_unsupported_group_size(gptq: Path) -> None:
    _edit_config(gptq, group_size=48)
    _fails(gptq, "quantization_config.group_size=48")


def test_gptq_v2_checkpoint_format(gptq: Path) -> None:
    _edit_config(gptq, checkpoint_format="gptq_v2")
    _fails(gptq, "checkpoint_format")


def test_quantize_flag_that_does_not_match(gptq: Path) -> None:
    _fails(gptq, "--quantize awq", quantize="awq")


def test_unknown_quantize_flag(gptq: Path) -> None:
    _fails(gptq, "--quantize 'int3'", quantize="int3")


def test_gptq_flag_on_a_dense_checkpoint(tiny_model) -> None:
    _fails(tiny_model("llama_gqa"), "--quantize gptq", "quantization_config", quantize="gptq")


def test_awq_unsupported_version(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = fixture_folder("awq-w4-g64", tokenizer_dir, tmp_path)
    _edit_config(folder, version="gemv")
    _fails(folder, "quantization_config.version")
