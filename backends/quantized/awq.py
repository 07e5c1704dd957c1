"""AWQ GEMM checkpoints: qweight / qzeros / scales, 4-bit with zero points.

On disk (K inputs, N outputs, G = K / group groups): qweight int32 [K, N / 8] and qzeros int32
[G, N / 8] pack 8 outputs per word in AWQ's order (word nibble i holds output column
8 c + ORDER[i]); scales [G, N]. w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backends.quantized.affine import AffineInt4
from backends.quantized.config import AWQConfig, QuantizationError
from backends.quantized.gptqmodel_kernels import KernelChoice, Layout
from backends.quantized.int4_linear import int4_kernel_name
from backends.quantized.linear import (
    LinearSpec,
    Parts,
    build_int4,
    check_dtype,
    check_shape,
    fused_bias,
)
from backends.quantized.packing import unpack_cols

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column ORDER[i] of its 8
_UNDO_ORDER = torch.tensor([ORDER.index(c) for c in range(8)])
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8 C] in true column order."""
    nibbles = unpack_cols(packed, 4).view(packed.shape[0], -1, 8)
    return nibbles[:, :, _UNDO_ORDER].reshape(packed.shape[0], -1)


@dataclass
class AWQWeight:
    q: torch.Tensor  # uint8 [N, K]
    zeros: torch.Tensor  # float32 [N, G]
    scales: torch.Tensor  # float32 [N, G]
    group_size: int

    def affine4(self) -> AffineInt4:
        return AffineInt4.from_int_zeros(self.q, self.scales, self.zeros, self.group_size)

    @staticmethod
    def build(spec: LinearSpec, weights: list[AWQWeight], bias: torch.Tensor | None) -> nn.Module:
        return build_int4(spec, [w.affine4() for w in weights], bias)


class AWQWeightsLoader:
    method = "awq"
    required = ("qweight", "qzeros", "scales")
    optional: tuple[str, ...] = ()

    def __init__(self, config: AWQConfig, kernels: str = "auto") -> None:
        if not config.zero_point:
            raise QuantizationError(
                "quantization_config.zero_point=false is not supported for AWQ GEMM"
            )
        self.config = config
        self.kernels = KernelChoice(kernels, Layout(
            "awq", config.bits, config.group_size, sym=False, desc_act=False,
        ))

    def kernel(self, device: torch.device, dtype: torch.dtype) -> str:
        return self.kernels.describe(device, dtype) or int4_kernel_name(device)

    def build(self, spec: LinearSpec, parts: list[Parts]) -> nn.Module:
        bias = fused_bias(spec, parts)
        module = self.kernels.build_checked(spec, parts, bias, self.check)
        if module is not None:
            return module
        shards = zip(spec.checkpoint_names, parts, spec.shards, strict=True)
        weights = [self.read(name, p, out, spec.in_features) for name, p, out in shards]
        return AWQWeight.build(spec, weights, bias)

    def read(self, name: str, parts: Parts, n: int, k: int) -> AWQWeight:
        self.check(name, parts, n, k)
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        q = unpack_awq(qweight).t().contiguous()
        zeros = unpack_awq(qzeros).float().t().contiguous()
        return AWQWeight(q, zeros, scales.float().t().contiguous(), self.config.group_size)

    def check(self, name: str, parts: Parts, n: int, k: int) -> None:
        group = self.config.group_size
        if k % group or n % 8:
            raise QuantizationError(
                f"{name}: a [{n}, {k}] weight does not fit AWQ GEMM packing with group {group}"
            )
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        for suffix in ("qweight", "qzeros"):
            check_dtype(f"{name}.{suffix}", parts[suffix], (torch.int32,))
        check_dtype(f"{name}.scales", scales, _FLOATS)
        check_shape(f"{name}.qweight", qweight, (k, n // 8))
        check_shape(f"{name}.qzeros", qzeros, (k // group, n // 8))
        check_shape(f"{name}.scales", scales, (k // group, n))
