"""EETQ (`--quantize eetq`): int8 per-output-channel symmetric weight-only, at load.

The checkpoint is a dense fp16 / bf16 / fp32 one; each (fused) linear is quantized once as it
is read, so the dense weights never all sit in memory at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backends.quantized.config import EETQConfig
from backends.quantized.int8_linear import Int8Linear, int8_kernel_name, quantize_per_channel
from backends.quantized.linear import LinearSpec, Parts, check_shape, fused_bias


@dataclass
class EETQWeight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    @classmethod
    def quantize(cls, dense: torch.Tensor) -> EETQWeight:
        return cls(*quantize_per_channel(dense))

    def build(self, spec: LinearSpec, bias: torch.Tensor | None) -> nn.Module:
        return Int8Linear(self.q, self.scale, bias, spec.device, spec.dtype, spec.shards)


class EETQWeightsLoader:
    method = "eetq"
    required = ("weight",)
    optional: tuple[str, ...] = ()

    def __init__(self, config: EETQConfig) -> None:
        self.config = config

    def kernel(self, device: torch.device, dtype: torch.dtype) -> str:
        return int8_kernel_name(device)

    def build(self, spec: LinearSpec, parts: list[Parts]) -> nn.Module:
        for name, p, out in zip(spec.checkpoint_names, parts, spec.shards, strict=True):
            check_shape(f"{name}.weight", p["weight"], (out, spec.in_features))
        dense = torch.cat([p["weight"] for p in parts])
        return EETQWeight.quantize(dense).build(spec, fused_bias(spec, parts))
