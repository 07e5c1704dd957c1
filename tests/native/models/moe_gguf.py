"""Tiny mixture-of-experts checkpoints as llama.cpp's converter writes them to GGUF: each
layer's experts stacked into one 3D tensor per projection (`blk.N.ffn_{gate,up,down}_exps`,
[n_expert, out, in] in torch order), the router as `blk.N.ffn_gate_inp`, the expert metadata
(`expert_count`, `expert_used_count`, qwen3moe's `expert_feed_forward_length`), Mixtral under
the llama architecture with its q / k rows permuted, and the default model's tokenizer."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from tests.native.models.tiny import gguf_writer
from tests.quantized.gguf_files import blocks

T = GGMLQuantizationType
ARCHS = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "olmoe": gguf.MODEL_ARCH.OLMOE,
         "mixtral": gguf.MODEL_ARCH.LLAMA}
_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
          "w1": "gate", "w3": "up", "w2": "down"}
# Qwen3-MoE's dense `mlp_only_layers` under llama.cpp's generic FFN names (its qwen3moe tensor
# map has no dense FFN, so its converter cannot write such a layer).
_DENSE_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")


def all_f32(kind: str) -> T:
    return T.F32


def write_moe_gguf(path: Path, folder: Path, tokenizer_gguf: str,
                   expert_type: Callable[[str], T] = all_f32, seed: int = 0,
                   stacked: bool = True) -> Path:
    """`folder`'s weights under llama.cpp's names, every tensor F32 except the experts:
    `expert_type(kind)` ("gate", "up", "down") picks their type (F32, or quantized by the gguf
    package, or random valid blocks of about the weights' spread for the k-quants it cannot
    quantize to). `stacked=False`: one 2D tensor per expert, `blk.N.ffn_gate.E.weight`, as
    llama.cpp wrote Mixtral before it stacked them."""
    config = AutoConfig.from_pretrained(folder)
    arch = ARCHS[config.model_type]
    writer = _writer(path, arch, config, tokenizer_gguf)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if match := _EXPERT_RE.match(name):
            layer, expert, proj = match.groups()
            experts.setdefault((int(layer), _KINDS[proj]), {})[int(expert)] = tensor
            continue
        if dense := _DENSE_RE.match(name):
            gguf_name = f"blk.{dense.group(1)}.ffn_{dense.group(2)}.weight"
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else \
                config.num_key_value_heads
            tensor = _permute(tensor, heads)
        writer.add_tensor(gguf_name, tensor.float().numpy())
    rng = np.random.default_rng(seed)
    for (layer, kind), by_expert in sorted(experts.items()):
        values = torch.stack([by_expert[e] for e in range(len(by_expert))]).float().numpy()
        if stacked:
            _add(writer, f"blk.{layer}.ffn_{kind}_exps.weight", values, expert_type(kind), rng)
            continue
        for expert, one in enumerate(values):
            _add(writer, f"blk.{layer}.ffn_{kind}.{expert}.weight", one, expert_type(kind), rng)
    return _close(writer, path)


def _writer(path: Path, arch: gguf.MODEL_ARCH, config: PretrainedConfig,
            tokenizer_gguf: str) -> GGUFWriter:
    """The metadata llama.cpp's converter writes for `config`: tiny.py's, plus the experts'."""
    writer = gguf_writer(path, arch, config, tokenizer_gguf)
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    elif config.model_type == "mixtral":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim or
                                        config.hidden_size // config.num_attention_heads)
    return writer


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q / k row order for its interleaved rotary (llama architecture only)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _add(writer: GGUFWriter, name: str, values: np.ndarray, qtype: T,
         rng: np.random.Generator) -> None:
    """values: [out, in] or [n_expert, out, in]; quantized types as rows of blocks."""
    if qtype == T.F32:
        writer.add_tensor(name, values)
        return
    rows = blocks(values.reshape(-1, values.shape[-1]), qtype, rng)
    writer.add_tensor(name, rows.reshape(*values.shape[:-1], -1), raw_dtype=qtype)


def _close(writer: GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
