"""Qwen3 (dense) over the paged KV cache: the Llama layer with an RMSNorm over each head of q
and of k (`q_norm`, `k_norm`, weights of size head_dim) between the projection and the rotary.

Everything else is Llama's: fused q/k/v and gate/up, the compiled layer halves
(`before_attention` calls `project`), the prepacked and quantized linears. The fused C++
decode layers (runner/fused_decode_layers.py) run this layer too, with their per-head q / k
norm.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from backends.native.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    apply_rotary,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__(config, head_dim)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] normed per head then rotated, v [T, KVH, D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shards, dim=-1)
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
