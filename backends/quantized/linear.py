"""What the per-format loaders share: the spec of one (possibly fused) linear, the Linear
modules that are not a kernel of their own, and the int4 build path with its fallbacks."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from backends.quantized.affine import AffineInt4, concat_rows
from backends.quantized.config import QuantizationError
from backends.quantized.int4_linear import Int4Linear

log = logging.getLogger(__name__)

Parts = dict[str, torch.Tensor]  # suffix ("qweight", "scales", "weight.absmax", ...) -> tensor


@dataclass(frozen=True)
class LinearSpec:
    """One Linear of the model: its checkpoint prefixes (one per fused shard) and sizes."""

    name: str  # module path in the model, e.g. "model.layers.0.self_attn.qkv_proj"
    checkpoint_names: list[str]  # e.g. ["model.layers.0.self_attn.q_proj", ...]
    in_features: int
    shards: list[int]  # output features of each checkpoint tensor, in order
    bias: bool
    device: torch.device
    dtype: torch.dtype

    @property
    def out_features(self) -> int:
        return sum(self.shards)


class WeightsLoader(Protocol):
    """Reads one format's tensors for a linear and builds its module."""

    method: str
    required: tuple[str, ...]  # suffixes every shard must have
    optional: tuple[str, ...]  # suffixes a shard may have (besides "bias")

    def build(self, spec: LinearSpec, parts: list[Parts]) -> nn.Module: ...

    def kernel(self, device: torch.device, dtype: torch.dtype) -> str: ...


class PendingLinear(nn.Module):
    """Stands where a quantized Linear will go until its tensors have all been read."""

    def __init__(self, spec: LinearSpec) -> None:
        super().__init__()
        self.spec = spec
        self.shards = spec.shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.spec.name} was never loaded")


class ShardedLinear(nn.Module):
    """Fused projections whose quantized shards cannot share one kernel call."""

    def __init__(self, parts: Sequence[nn.Module], shards: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.shards = shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class DenseLinear(nn.Module):
    """A dequantized weight: for layouts no kernel takes, and `--quantize none`."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
        dtype: torch.dtype, shards: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(device, dtype))
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        self.shards = shards or [weight.shape[0]]
        self.kernel = "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise QuantizationError(
            f"tensor {name}: shape {tuple(tensor.shape)} != expected {expected}"
        )


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise QuantizationError(f"tensor {name}: dtype {tensor.dtype} is not {names}")


def fused_bias(spec: LinearSpec, parts: list[Parts]) -> torch.Tensor | None:
    """The shards' biases concatenated, or None; every shard must agree with the config."""
    biases = [p.get("bias") for p in parts]
    if not spec.bias:
        if any(b is not None for b in biases):
            raise QuantizationError(
                f"tensor {spec.checkpoint_names[0]}.bias: the config declares no bias"
            )
        return None
    for name, bias, size in zip(spec.checkpoint_names, biases, spec.shards, strict=True):
        if bias is None:
            raise QuantizationError(f"checkpoint lacks tensor {name}.bias")
        check_shape(f"{name}.bias", bias, (size,))
    return torch.cat([b.float() for b in biases])  # type: ignore[union-attr]


def build_int4(spec: LinearSpec, weights: list[AffineInt4], bias: torch.Tensor | None) -> nn.Module:
    """One Int4Linear over all shards when their layouts match, else one per shard; a dense
    (dequantized) weight where no kernel layout exists."""
    fused = concat_rows(weights)
    if fused is not None:
        return _int4_or_dense(spec.name, fused, bias, spec, spec.shards)
    log.info("%s: shards differ in layout (group / act order); kept as separate kernels",
             spec.name)
    offsets = [sum(spec.shards[:i]) for i in range(len(spec.shards))]
    parts = [
        _int4_or_dense(
            f"{spec.name}[{i}]", w,
            None if bias is None else bias[offsets[i]: offsets[i] + spec.shards[i]], spec, None,
        )
        for i, w in enumerate(weights)
    ]
    return ShardedLinear(parts, spec.shards)


def _int4_or_dense(
    name: str, weight: AffineInt4, bias: torch.Tensor | None, spec: LinearSpec,
    shards: list[int] | None,
) -> nn.Module:
    try:
        return Int4Linear(weight, bias, spec.device, spec.dtype, shards)
    except ValueError as exc:
        log.warning("%s: %s; dequantized instead", name, exc)
        return DenseLinear(weight.dense(), bias, spec.device, spec.dtype, shards)
