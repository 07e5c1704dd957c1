"""OLMoE over the paged KV cache: Llama's layer with an RMSNorm over the whole q and the whole
k projection (`q_norm` of num_heads * head_dim, `k_norm` of num_kv_heads * head_dim, not per
head as Qwen3's) before the rotary, q / k / v clamped to +-`clip_qkv` where set, and a sparse
MoE block (models/moe.py) on every layer: experts of `intermediate_size`, top-k weights
renormalised only with `norm_topk_prob`."""

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
from backends.native.models.moe import MoECausalLM, SparseMoeBlock

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__(config, head_dim)
        self.q_norm = RMSNorm(self.num_heads * head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * head_dim, config.rms_norm_eps)
        self.clip_qkv: float | None = getattr(config, "clip_qkv", None)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] normed whole then rotated, v [T, KVH, D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shards, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (p.clamp(-self.clip_qkv, self.clip_qkv) for p in (q, k, v))
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.reshape(t, self.num_kv_heads, self.head_dim)


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention


class OlmoeForCausalLM(MoECausalLM, LlamaForCausalLM):
    layer_class = OlmoeDecoderLayer

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        for layer in self.model.layers:
            layer.mlp = SparseMoeBlock(
                config.hidden_size, config.num_experts, config.num_experts_per_tok,
                config.intermediate_size, bool(config.norm_topk_prob))

    def quantizable_linears(self, include_lm_head: bool = False) -> dict[str, list[str]]:
        targets = super().quantizable_linears(include_lm_head)
        for i in range(len(self.model.layers)):
            del targets[f"model.layers.{i}.mlp.gate_up_proj"]
            del targets[f"model.layers.{i}.mlp.down_proj"]
            targets.update(self.expert_linears(i, "mlp", EXPERT_NAMES))
        return targets
