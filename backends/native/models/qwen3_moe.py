"""Qwen3-MoE over the paged KV cache: Qwen3's attention (per-head q / k RMSNorm) with a sparse
MoE block (models/moe.py) in place of the MLP on the layers `decoder_sparse_step` and
`mlp_only_layers` select; the other layers keep a dense MLP of `intermediate_size`. Experts
are of `moe_intermediate_size`, top-k weights renormalised only with `norm_topk_prob`."""

from __future__ import annotations

from transformers import PretrainedConfig

from backends.native.models.moe import MoECausalLM, SparseMoeBlock
from backends.native.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer; its `mlp` is set by the model (sparse or dense per layer)."""


def is_sparse(config: PretrainedConfig, layer: int) -> bool:
    """Whether transformers gives layer `layer` the MoE block."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer + 1) % step == 0)


class Qwen3MoeForCausalLM(MoECausalLM, Qwen3ForCausalLM):
    layer_class = Qwen3MoeDecoderLayer

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        for i, layer in enumerate(self.model.layers):
            if is_sparse(config, i):
                layer.mlp = SparseMoeBlock(
                    config.hidden_size, config.num_experts, config.num_experts_per_tok,
                    config.moe_intermediate_size, bool(config.norm_topk_prob))

    def quantizable_linears(self, include_lm_head: bool = False) -> dict[str, list[str]]:
        targets = super().quantizable_linears(include_lm_head)
        for i in range(len(self.model.layers)):
            if is_sparse(self.config, i):
                del targets[f"model.layers.{i}.mlp.gate_up_proj"]
                del targets[f"model.layers.{i}.mlp.down_proj"]
                targets.update(self.expert_linears(i, "mlp", EXPERT_NAMES))
        return targets
