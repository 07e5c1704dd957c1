"""Tiny random checkpoints for the architecture tests: a transformers model saved with
save_pretrained beside the shared tokenizer, and the same weights as llama.cpp's converter
would write them to a GGUF file."""

from __future__ import annotations

import functools
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from tests.quantized.gguf_files import _copy_tokenizer

VOCAB = 49152  # the shared tokenizer's
TINY = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_tiny(
    folder: Path, tokenizer_dir: Path, config: PretrainedConfig, seed: int = 0,
    tweak: Callable[[str, torch.nn.Parameter], None] | None = None,
) -> Path:
    """A random model of `config` saved to `folder`; `tweak(name, param)` may change any
    parameter first (in place, under no_grad)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if tweak is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                tweak(name, param)
    model.save_pretrained(folder, safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, folder / item.name)
    return folder


def write_qwen3_gguf(path: Path, folder: Path, tokenizer_gguf: str) -> Path:
    """`folder`'s weights as F32 tensors under llama.cpp's qwen3 names (unpermuted: its
    converter permutes q/k rows for llama only), with the metadata its Qwen3 converter writes
    and the default model's tokenizer."""
    config = AutoModelForCausalLM.from_pretrained(folder).config
    writer = gguf_writer(path, gguf.MODEL_ARCH.QWEN3, config, tokenizer_gguf)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    return _finish(writer, path, folder, gguf.MODEL_ARCH.QWEN3, config)


def write_phi3_gguf(path: Path, folder: Path, tokenizer_gguf: str) -> Path:
    """`folder`'s weights under llama.cpp's phi3 names (attn_qkv and ffn_up stay fused), with
    the metadata and LongRoPE factor tensors its Phi3 converter writes."""
    config = AutoModelForCausalLM.from_pretrained(folder).config
    writer = gguf_writer(path, gguf.MODEL_ARCH.PHI3, config, tokenizer_gguf)
    head_dim = config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    return _finish(writer, path, folder, gguf.MODEL_ARCH.PHI3, config)


def write_gemma3_gguf(path: Path, folder: Path, tokenizer_gguf: str) -> Path:
    """`folder`'s weights under llama.cpp's gemma3 names with every norm weight plus 1, and
    the metadata its Gemma3 converter writes: the global layers' rotary base and linear
    scaling, the window, no pattern and no local base (llama.cpp's defaults: every sixth
    layer global, base 10000)."""
    config = AutoModelForCausalLM.from_pretrained(folder).config
    writer = gguf_writer(path, gguf.MODEL_ARCH.GEMMA3, config, tokenizer_gguf)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters["full_attention"]
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    return _finish(writer, path, folder, gguf.MODEL_ARCH.GEMMA3, config,
                   shift=lambda name: 1.0 if name.endswith("norm.weight") else 0.0)


@functools.cache
def tokenizer_source(path: str) -> gguf.GGUFReader:
    """The default model's file, parsed once (its token arrays take seconds)."""
    return gguf.GGUFReader(path)


def gguf_writer(path: Path, arch: gguf.MODEL_ARCH, config: PretrainedConfig,
            tokenizer_gguf: str) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _copy_tokenizer(writer, tokenizer_source(tokenizer_gguf))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = config.rope_parameters  # Gemma 3's: one set per kind of layer, the global's here
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    return writer


def _finish(writer: gguf.GGUFWriter, path: Path, folder: Path, arch: gguf.MODEL_ARCH,
            config: PretrainedConfig, shift: Callable[[str], float] = lambda name: 0.0) -> Path:
    """`shift(name)`: what the converter adds to that tensor."""
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    # The saved file, not the model's state: a tied lm_head is not in it (no output.weight).
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, (tensor.float() + shift(name)).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
