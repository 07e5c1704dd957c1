"""Mixtral over the paged KV cache: Llama's (Mistral's) attention, and a sparse MoE block
(models/moe.py) on every layer, experts of `intermediate_size`, top-k weights always
renormalised and applied in float32 as transformers' router returns them.

Checkpoints name the block `block_sparse_moe` and an expert's projections w1 / w3 / w2
(gate / up / down); the model names them as the other MoE models do (`mlp.gate`,
`mlp.experts.E.gate_up_proj` / `down_proj`), and reads the checkpoint's names onto them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from backends.native.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from backends.native.models.moe import MoECausalLM, SparseMoeBlock

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down
# checkpoint name fragment -> the model's
RENAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
           ".w2.": ".down_proj."}


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's layer; its `mlp` is the model's MoE block."""


class MixtralForCausalLM(MoECausalLM, LlamaForCausalLM):
    layer_class = MixtralDecoderLayer

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        for layer in self.model.layers:
            layer.mlp = SparseMoeBlock(
                config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                config.intermediate_size, renormalize=True, float32_weights=True)

    def quantizable_linears(self, include_lm_head: bool = False) -> dict[str, list[str]]:
        targets = super().quantizable_linears(include_lm_head)
        for i in range(len(self.model.layers)):
            del targets[f"model.layers.{i}.mlp.gate_up_proj"]
            del targets[f"model.layers.{i}.mlp.down_proj"]
            targets.update(self.expert_linears(i, "block_sparse_moe", EXPERT_NAMES))
        return targets

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str:
        for theirs, ours in RENAMES.items():
            name = name.replace(theirs, ours)
        return super()._load_one(params, name, tensor)
