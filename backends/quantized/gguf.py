"""GGUF tensors kept quantized: Q4_0 / Q4_1 / Q4_K as int4 (group 32), Q8_0 as 8-bit for our kernel
(`q8_linear.py`) or, where our kernels do not run, as two int4 halves, Q5_0 / Q5_1 / Q5_K / Q6_K
as the file's own blocks for our k-quant kernel (`kquant_linear.py`). Any other type (Q2_K,
Q3_K, IQ*) and any Linear where no kernel runs is dequantized by the gguf package at load, and
so recorded: each built module carries a `GGUFSource` (its tensors, their types, kept or why
not), which `gguf_formats(model)` gathers for /info. Float weights (F32 / F16 / BF16) stay
dense.

Q4_K stays int4 rather than on the k-quant kernel: its decode products measured slower there
(bench/quantized.py's kquant rows); the int4 layout takes 5 bits a weight against the file's
4.5.

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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize
from torch import nn

from backends.quantized import kquant_linear, q8_linear
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
INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K)  # packed as int4 (Q8_0: or 8-bit, q8_linear)
KQUANT_TYPES = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K)  # the file's blocks, kquant_linear
# Every block type reaches the loader as its blocks (GGUFRaw): the loader packs them, or
# dequantizes them itself with the reason recorded.
KEPT_TYPES = tuple(t for t, (block, _) in GGML_QUANT_SIZES.items() if block > 1)
FLOAT_REASON = "float weights stay dense"


@dataclass(frozen=True)
class GGUFSource:
    """What a built Linear holds: its GGUF tensors and their types, kept packed or dense."""

    tensors: list[str]
    types: list[str]
    reasons: list[str]  # why each is dense; empty where kept packed

    @property
    def kept(self) -> bool:
        return not any(self.reasons)


@dataclass(frozen=True)
class ExpandedTensor:
    tensor: str
    type: str
    reason: str


@dataclass(frozen=True)
class GGUFFormats:
    """/info's `gguf_formats`: the types kept packed, and each tensor dequantized with why."""

    kept: list[str]
    expanded: list[ExpandedTensor]

    def report(self) -> dict[str, object]:
        return {"kept": self.kept,
                "expanded": [{"tensor": e.tensor, "type": e.type, "reason": e.reason}
                             for e in self.expanded]}


def gguf_formats(model: nn.Module) -> GGUFFormats:
    """The GGUFSource records of every Linear the loader built in `model`."""
    sources = [s for m in model.modules() if isinstance(s := getattr(m, "gguf_source", None),
                                                        GGUFSource)]
    kept = sorted({t for s in sources if s.kept for t in s.types})
    expanded = [ExpandedTensor(name, kind, reason) for s in sources
                for name, kind, reason in zip(s.tensors, s.types, s.reasons, strict=True)
                if reason]
    return GGUFFormats(kept, expanded)


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
        kept = "/".join(t.name for t in INT4_TYPES)
        q8 = (f"; Q8_0: {q8_linear.q8_kernel_name()}"
              if q8_linear.available(device, dtype) else "")
        kquant = "/".join(t.name for t in KQUANT_TYPES)
        kquant += (f": {kquant_linear.kquant_kernel_name()}"
                   if kquant_linear.available(device, dtype) else " dequantized here")
        return f"{kept}: {int4_kernel_name(device)}{q8}; {kquant}; other types dequantized at load"

    def build(self, spec: LinearSpec, parts: list[Parts]) -> nn.Module:
        bias = fused_bias(spec, parts)
        weights = [p["weight"] for p in parts]
        for name, w, out in zip(spec.checkpoint_names, weights, spec.shards, strict=True):
            if tuple(w.shape) != (out, spec.in_features):
                raise QuantizationError(
                    f"tensor {name}.weight: shape {tuple(w.shape)} != expected "
                    f"{(out, spec.in_features)}"
                )
        types = {w.qtype if isinstance(w, GGUFRaw) else None for w in weights}
        qtype = types.pop() if len(types) == 1 else None
        int4 = all(isinstance(w, GGUFRaw) and w.qtype in INT4_TYPES for w in weights)
        if qtype is None and not int4 and any(_packable(w, spec) for w in weights):
            # mixed types (e.g. Q4_K_M files' q / k Q4_K beside a Q6_K v): each shard alone
            return ShardedLinear([self.build(sub, [p]) for sub, p in _split(spec, parts)],
                                 spec.shards)
        module = self._module(spec, qtype, int4, weights, bias)
        names = [w.name if isinstance(w, GGUFRaw) else f"{n}.weight"
                 for w, n in zip(weights, spec.checkpoint_names, strict=True)]
        kinds = [w.qtype.name if isinstance(w, GGUFRaw) else "float" for w in weights]
        reasons = [_dense_reason(w, spec) or "no int4 kernel layout for this shape"
                   for w in weights] if isinstance(module, DenseLinear) else ["" for _ in weights]
        module.gguf_source = GGUFSource(names, kinds, reasons)
        return module

    def _module(self, spec: LinearSpec, qtype: GGMLQuantizationType | None, int4: bool,
                weights: list[torch.Tensor | GGUFRaw], bias: torch.Tensor | None) -> nn.Module:
        """The Linear for shards of one type (qtype; None: float or mixed), or all of int4
        types."""
        if qtype == T.Q8_0 and q8_linear.runs_here(spec.out_features, spec.in_features,
                                                   spec.device, spec.dtype):
            values = [q8_0_values(w) for w in weights]  # type: ignore[arg-type]
            return q8_linear.Q8Linear(torch.cat([q for q, _ in values]),
                                      torch.cat([d for _, d in values]), bias, spec.device,
                                      spec.dtype, spec.shards)
        if int4:
            return build_int4(spec, [affine(w) for w in weights], bias)  # type: ignore[arg-type]
        if qtype in KQUANT_TYPES and kquant_linear.available(spec.device, spec.dtype):
            blocks = torch.cat([w.data for w in weights])  # type: ignore[union-attr]
            return kquant_linear.KQuantLinear(blocks, qtype, spec.in_features, bias, spec.device,
                                              spec.dtype, spec.shards)
        dense = torch.cat([w.dense() if isinstance(w, GGUFRaw) else w.float() for w in weights])
        return DenseLinear(dense, bias, spec.device, spec.dtype, spec.shards)


def _dense_reason(weight: torch.Tensor | GGUFRaw, spec: LinearSpec) -> str:
    """Why a weight of this type is dequantized here ("" for a type that packs)."""
    if not isinstance(weight, GGUFRaw):
        return FLOAT_REASON
    if weight.qtype in KQUANT_TYPES:
        return "" if kquant_linear.available(spec.device, spec.dtype) else \
            kquant_linear.unavailable_reason(spec.device, spec.dtype)
    return "" if weight.qtype in INT4_TYPES else f"no kernel for {weight.qtype.name}"


def _packable(weight: torch.Tensor | GGUFRaw, spec: LinearSpec) -> bool:
    return isinstance(weight, GGUFRaw) and not _dense_reason(weight, spec)


def _split(spec: LinearSpec, parts: list[Parts]) -> list[tuple[LinearSpec, Parts]]:
    return [
        (replace(spec, name=f"{spec.name}[{i}]", checkpoint_names=[name], shards=[out]), p)
        for i, (name, out, p) in enumerate(
            zip(spec.checkpoint_names, spec.shards, parts, strict=True)
        )
    ]
