"""GGUF tensors kept quantized: Q4_0 / Q4_1 / Q4_K as int4 (group 32), Q8_0 as 8-bit for our
AVX2 kernel (`q8_linear.py`) or else as two int4 halves; any other type (Q6_K, Q5_*, F16, ...)
is dequantized by the gguf package at load.

Block layouts (ggml), per 32 weights unless said: Q4_0 = fp16 d + 16 bytes of nibbles
(w = (q - 8) d); Q4_1 = fp16 d, fp16 m + nibbles (w = q d + m); Q8_0 = fp16 d + 32 int8
(w = q d); Q4_K per 256 = fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks,
128 bytes of nibbles (w = d sc q - dmin m). Nibbles: byte j low = weight j, high = j + 16
(Q4_K: a 64-weight chunk's byte j low = weight j, high = weight j + 32).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize
from torch import nn

from backends.quantized import q8_linear
from backends.quantized.affine import AffineInt4, AffineInt8
from backends.quantized.config import GGUFConfig, QuantizationError
from backends.quantized.int4_linear import int4_kernel_name
from backends.quantized.linear import (
    DenseLinear,
    LinearSpec,
    Parts,
    ShardedLinear,
    build_int4,
    fused_bias,
)

T = GGMLQuantizationType
KEPT_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K)


@dataclass
class GGUFRaw:
    """A GGUF tensor's blocks, one row per output feature: uint8 [N, bytes per row]."""

    name: str  # the GGUF tensor name, for messages
    qtype: GGMLQuantizationType
    data: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.in_features)

    def rows(self, index: torch.Tensor) -> GGUFRaw:
        return GGUFRaw(self.name, self.qtype, self.data[index], self.in_features)

    def dense(self) -> torch.Tensor:
        values = dequantize(self.data.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)


def _blocks(raw: GGUFRaw, size: int) -> torch.Tensor:
    n = raw.data.shape[0]
    return raw.data.reshape(n, -1, size)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last dim's 2 bytes, as float32 [..]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 16] bytes -> [N, B * 32] values: low nibbles first, then high."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).reshape(qs.shape[0], -1)


def affine_q4_0(raw: GGUFRaw) -> AffineInt4:
    b = _blocks(raw, 18)
    d = _f16(b[..., 0:2])
    return AffineInt4(_nibbles32(b[..., 2:]), d, torch.zeros_like(d), 32)


def affine_q4_1(raw: GGUFRaw) -> AffineInt4:
    b = _blocks(raw, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return AffineInt4(_nibbles32(b[..., 4:]), d, m + 8 * d, 32)


def q8_0_values(raw: GGUFRaw) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and float32 scales [N, K / 32]: w = q * scale."""
    b = _blocks(raw, 34)
    return b[..., 2:].contiguous().view(torch.int8).reshape(b.shape[0], -1), _f16(b[..., 0:2])


def affine_q8_0(raw: GGUFRaw) -> AffineInt4:
    q, d = q8_0_values(raw)
    q = (q.to(torch.int16) + 128).to(torch.uint8)
    return AffineInt8(q, d, torch.full_like(d, 128.0), 32).as_int4_halves()


def affine_q4_k(raw: GGUFRaw) -> AffineInt4:
    b = _blocks(raw, 144)
    n, blocks = b.shape[:2]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mins = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12).numpy())
    sc = torch.from_numpy(sc.astype(np.float32)).view(n, blocks, 8)
    mins = torch.from_numpy(mins.astype(np.float32)).view(n, blocks, 8)
    scale = (d.unsqueeze(-1) * sc).view(n, -1)
    zero = (-dmin.unsqueeze(-1) * mins).view(n, -1) + 8 * scale
    qs = b[..., 16:].reshape(n, blocks, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, -1)
    return AffineInt4(q, scale, zero, 32)


_AFFINE = {T.Q4_0: affine_q4_0, T.Q4_1: affine_q4_1, T.Q8_0: affine_q8_0, T.Q4_K: affine_q4_k}


def affine(raw: GGUFRaw) -> AffineInt4:
    return _AFFINE[raw.qtype](raw)


class GGUFWeightsLoader:
    method = "gguf"
    required = ("weight",)
    optional: tuple[str, ...] = ()

    def __init__(self, config: GGUFConfig) -> None:
        self.config = config

    def kernel(self, device: torch.device, dtype: torch.dtype) -> str:
        kept = "/".join(t.name for t in KEPT_TYPES)
        q8 = (f"; Q8_0: {q8_linear.q8_kernel_name()}"
              if q8_linear.available(device, dtype) else "")
        return f"{kept}: {int4_kernel_name(device)}{q8}; other types dequantized at load"

    def build(self, spec: LinearSpec, parts: list[Parts]) -> nn.Module:
        bias = fused_bias(spec, parts)
        weights = [p["weight"] for p in parts]
        for name, w, out in zip(spec.checkpoint_names, weights, spec.shards, strict=True):
            if tuple(w.shape) != (out, spec.in_features):
                raise QuantizationError(
                    f"tensor {name}.weight: shape {tuple(w.shape)} != expected "
                    f"{(out, spec.in_features)}"
                )
        kept = [isinstance(w, GGUFRaw) and w.qtype in KEPT_TYPES for w in weights]
        if all(isinstance(w, GGUFRaw) and w.qtype == T.Q8_0 for w in weights) and \
                q8_linear.runs_here(spec.out_features, spec.in_features, spec.device, spec.dtype):
            values = [q8_0_values(w) for w in weights]  # type: ignore[arg-type]
            return q8_linear.Q8Linear(torch.cat([q for q, _ in values]),
                                      torch.cat([d for _, d in values]), bias, spec.device,
                                      spec.dtype, spec.shards)
        if all(kept):
            return build_int4(spec, [affine(w) for w in weights], bias)  # type: ignore[arg-type]
        if any(kept):  # mixed types (e.g. Q4_K_M files): each shard on its own
            return ShardedLinear([self.build(sub, [p]) for sub, p in _split(spec, parts)],
                                 spec.shards)
        dense = torch.cat([w.dense() if isinstance(w, GGUFRaw) else w.float() for w in weights])
        return DenseLinear(dense, bias, spec.device, spec.dtype, spec.shards)


def _split(spec: LinearSpec, parts: list[Parts]) -> list[tuple[LinearSpec, Parts]]:
    return [
        (replace(spec, name=f"{spec.name}[{i}]", checkpoint_names=[name], shards=[out]), p)
        for i, (name, out, p) in enumerate(
            zip(spec.checkpoint_names, spec.shards, parts, strict=True)
        )
    ]
