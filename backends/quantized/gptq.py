"""GPTQ v1 checkpoints: qweight / qzeros / scales / g_idx, 4- or 8-bit, sym or asym.

On disk (per linear, K inputs, N outputs, G groups): qweight int32 [K * bits / 32, N] packs
consecutive input rows low bits first; qzeros int32 [G, N * bits / 32] packs consecutive
outputs; scales [G, N]; g_idx [K] the group of each input feature (act order when not
monotonic). v1 stores each zero point minus one: w = scales[g] * (q - (qzeros[g] + 1)).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from backends.quantized.affine import AffineInt4, AffineInt8, groups_to_perm
from backends.quantized.config import GPTQConfig, QuantizationError
from backends.quantized.gptqmodel_kernels import KernelChoice, Layout
from backends.quantized.int4_linear import int4_kernel_name
from backends.quantized.int8_linear import Int8Linear, int8_kernel_name
from backends.quantized.linear import (
    LinearSpec,
    Parts,
    build_int4,
    check_dtype,
    check_shape,
    fused_bias,
)
from backends.quantized.packing import unpack_cols, unpack_rows

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class GPTQWeight:
    """One checkpoint linear, unpacked: q / zeros / scales in kernel column order."""

    q: torch.Tensor  # uint8 [N, K], columns in `perm` order
    zeros: torch.Tensor  # float32 [N, G] integer zero points
    scales: torch.Tensor  # float32 [N, G]
    group_size: int
    perm: torch.Tensor | None
    bits: int

    def affine4(self) -> AffineInt4:
        return AffineInt4.from_int_zeros(self.q, self.scales, self.zeros, self.group_size,
                                         self.perm)

    def affine8(self) -> AffineInt8:
        return AffineInt8(self.q, self.scales, self.zeros, self.group_size, self.perm)

    def as_int4(self) -> AffineInt4:
        """4-bit as it is, 8-bit as two exact 4-bit halves."""
        return self.affine4() if self.bits == 4 else self.affine8().as_int4_halves()

    @staticmethod
    def build(spec: LinearSpec, weights: list[GPTQWeight], bias: torch.Tensor | None) -> nn.Module:
        if all(w.bits == 8 for w in weights):
            eights = [w.affine8() for w in weights]
            if all(w.symmetric_per_channel() and w.perm is None for w in eights):
                q = torch.cat([(w.q.to(torch.int16) - 128).to(torch.int8) for w in eights])
                scale = torch.cat([w.scale[:, 0] for w in eights])
                return Int8Linear(q, scale, bias, spec.device, spec.dtype, spec.shards)
        return build_int4(spec, [w.as_int4() for w in weights], bias)


class GPTQWeightsLoader:
    method = "gptq"
    required = ("qweight", "qzeros", "scales")
    optional = ("g_idx",)

    def __init__(self, config: GPTQConfig, kernels: str = "auto") -> None:
        self.config = config
        self.kernels_setting = kernels
        self._choices: dict[GPTQConfig, KernelChoice] = {}

    def choice(self, config: GPTQConfig) -> KernelChoice:
        """The kernel choice for one layout (per-module overrides may add layouts)."""
        if config not in self._choices:
            self._choices[config] = KernelChoice(self.kernels_setting, Layout(
                "gptq", config.bits, config.group_size, config.sym, config.desc_act,
            ))
        return self._choices[config]

    def kernel(self, device: torch.device, dtype: torch.dtype) -> str:
        config = replace(self.config, dynamic=())  # the layout without per-module overrides
        gptqmodel = self.choice(config).describe(device, dtype)
        if gptqmodel is not None:
            return gptqmodel
        if config.bits == 8 and config.group_size == -1 and config.sym:
            return int8_kernel_name(device)
        halves = " (8-bit as two 4-bit halves)" if config.bits == 8 else ""
        return int4_kernel_name(device) + halves

    def build(self, spec: LinearSpec, parts: list[Parts]) -> nn.Module:
        bias = fused_bias(spec, parts)
        layouts = {self.layout(name) for name in spec.checkpoint_names}
        if len(layouts) == 1:  # shards with different overrides run the native kernels
            module = self.choice(layouts.pop()).build_checked(spec, parts, bias, self.check)
            if module is not None:
                return module
        shards = zip(spec.checkpoint_names, parts, spec.shards, strict=True)
        weights = [self.read(name, p, out, spec.in_features) for name, p, out in shards]
        return GPTQWeight.build(spec, weights, bias)

    def layout(self, name: str) -> GPTQConfig:
        config = self.config.for_module(name)
        if config is None:
            raise QuantizationError(f"{name}: the checkpoint's dynamic rules leave it unquantized, "
                                    "but it is fused with quantized projections")
        return config

    def check(self, name: str, parts: Parts, n: int, k: int) -> torch.Tensor | None:
        """Checks one shard's tensors; returns its act-order column permutation, if any."""
        config = self.layout(name)
        bits, group = config.bits, (k if config.group_size == -1 else config.group_size)
        if k % group:
            raise QuantizationError(f"{name}: in_features {k} is not a multiple of group_size "
                                    f"{group}")
        groups, per_int = k // group, 32 // bits
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        for suffix in ("qweight", "qzeros"):
            check_dtype(f"{name}.{suffix}", parts[suffix], (torch.int32,))
        check_dtype(f"{name}.scales", scales, _FLOATS)
        check_shape(f"{name}.qweight", qweight, (k // per_int, n))
        check_shape(f"{name}.qzeros", qzeros, (groups, -(-n // per_int)))
        check_shape(f"{name}.scales", scales, (groups, n))
        return self._perm(name, parts.get("g_idx"), k, group, groups, config.desc_act)

    def read(self, name: str, parts: Parts, n: int, k: int) -> GPTQWeight:
        perm = self.check(name, parts, n, k)
        config = self.layout(name)
        bits, group = config.bits, (k if config.group_size == -1 else config.group_size)
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        q = unpack_rows(qweight, bits).t()  # [N, K]
        if perm is not None:
            q = q[:, perm]
        zeros = unpack_cols(qzeros, bits)[:, :n].float() + 1  # v1: stored minus one
        return GPTQWeight(q.contiguous(), zeros.t().contiguous(), scales.float().t().contiguous(),
                          group, perm, bits)

    def _perm(
        self, name: str, g_idx: torch.Tensor | None, k: int, group: int, groups: int,
        desc_act: bool,
    ) -> torch.Tensor | None:
        if g_idx is None:
            if desc_act:
                raise QuantizationError(f"checkpoint lacks tensor {name}.g_idx (desc_act=true)")
            return None
        check_shape(f"{name}.g_idx", g_idx, (k,))
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise QuantizationError(f"tensor {name}.g_idx: group indices outside 0..{groups - 1}")
        try:
            return groups_to_perm(g_idx, group)
        except ValueError as exc:
            raise QuantizationError(f"tensor {name}.g_idx: {exc}") from None

