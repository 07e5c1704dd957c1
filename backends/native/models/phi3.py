"""Phi-3 / Phi-3.5 / Phi-4-mini over the paged KV cache: Llama's layer with q/k/v and gate/up
already fused in the checkpoint, LongRoPE, and partial rotary (Phi-4-mini rotates the first
`partial_rotary_factor` of each head's dims; the rest pass through).

LongRoPE positions past `original_max_position_embeddings` use the long factors, those before
it the short ones, per token: a sequence within the threshold matches transformers exactly;
past it, transformers recomputes every position with the long factors instead.

Per position, not per sequence: a cached K row depends on its tokens and position only (so
prefix caching and batching stay exact) and no cache is recomputed when a sequence crosses the
threshold. A fully rotated model keeps Llama's own layer, so the fused C++ decode layers take
it; a partially rotated one runs the compiled layer regions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backends.native.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    Rotary,
    apply_rotary,
    rotary_tables,
)
from backends.native.models.support import rope_type

if TYPE_CHECKING:
    from backends.quantized.loading import QuantizedLinears


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim(config: PretrainedConfig) -> int:
    """How many leading dims of each head are rotated (transformers' `int(head_dim * factor)`)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim_of(config) * (factor or 1.0))


def original_max_positions(config: PretrainedConfig) -> int:
    """The LongRoPE threshold: positions from here on take the long factors."""
    params = getattr(config, "rope_parameters", None) or {}
    value = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    return int(value or config.max_position_embeddings)


class Phi3Rotary(Rotary):
    """cos/sin over the rotated dims only; LongRoPE's short table below the threshold, its
    long table from the threshold on (both scaled by its attention factor)."""

    def tables(
        self, config: PretrainedConfig, head_dim: int, max_positions: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dim = rotary_dim(config)
        positions = torch.arange(max_positions)
        if rope_type(config) != "longrope":
            base = config.rope_parameters["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            return rotary_tables(inv_freq, 1.0, positions)
        threshold = original_max_positions(config)
        longrope = ROPE_INIT_FUNCTIONS["longrope"]
        short, scaling = longrope(config, "cpu")
        long, _ = longrope(config, "cpu", seq_len=threshold + 1)
        cos_short, sin_short = rotary_tables(short, scaling, positions[:threshold])
        cos_long, sin_long = rotary_tables(long, scaling, positions[threshold:])
        cos, sin = torch.cat((cos_short, cos_long)), torch.cat((sin_short, sin_long))
        assert cos.shape[-1] == dim
        return cos, sin


class Phi3Attention(LlamaAttention):
    """Rotates the first `rotary_dim` dims of each q / k head; the others pass through."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__(config, head_dim)
        self.rotary_dim = rotary_dim(config)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] partly rotated, v [T, KVH, D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shards, dim=-1)
        q = self._rotate(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = self._rotate(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = apply_rotary(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention


class Phi3ForCausalLM(LlamaForCausalLM):
    rotary_class = Phi3Rotary

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        partial = rotary_dim(config) < head_dim_of(config)
        self.layer_class = Phi3DecoderLayer if partial else LlamaDecoderLayer
        super().__init__(config, max_positions)

    def load_weights(
        self, tensors: Iterable[tuple[str, Any]], quantized: QuantizedLinears | None = None,
    ) -> None:
        """The checkpoint's fused qkv_proj / gate_up_proj (also a GGUF's attn_qkv / ffn_up) are
        split by rows into Llama's names, then loaded as Llama's: into the same fused modules,
        or into quantized ones."""
        super().load_weights(self._unfused(tensors), quantized)

    def _fused_parts(self) -> dict[str, list[tuple[str, int]]]:
        hd, config = self.head_dim, self.config
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * hd
        inter = config.intermediate_size
        return {
            "qkv_proj": [("q_proj", config.num_attention_heads * hd), ("k_proj", kv),
                         ("v_proj", kv)],
            "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)],
        }

    def _unfused(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        fused = self._fused_parts()
        for name, tensor in tensors:
            prefix, _, leaf = name.rpartition(".")
            block, _, module = prefix.rpartition(".")
            parts = fused.get(module)
            if parts is None:
                yield name, tensor
                continue
            start = 0
            for part, size in parts:
                yield f"{block}.{part}.{leaf}", _rows(tensor, start, size)
                start += size
            if start != _row_count(tensor):
                raise ValueError(f"tensor {name}: {_row_count(tensor)} rows != expected {start}")


def _rows(tensor: Any, start: int, size: int) -> Any:
    """Rows of a dense tensor, or of a GGUF file's blocks (`GGUFRaw`: blocks never cross rows)."""
    if isinstance(tensor, torch.Tensor):
        return tensor[start : start + size]
    return tensor.rows(torch.arange(start, start + size))


def _row_count(tensor: Any) -> int:
    return int(tensor.shape[0]) if isinstance(tensor, torch.Tensor) else int(tensor.data.shape[0])
