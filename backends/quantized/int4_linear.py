"""Int4Linear: 4-bit weights packed for a weight-only int4 kernel.

CPU, where our kernels build (`backends/cpu_kernels/int8_dot.cpp`, AVX-512 VNNI or AVX2): inputs
quantized to int8 per 32 columns in two passes (`INT8_DOT_FINE`), integer dot products, below
`INT8_DOT_DENSE_MIN_ROWS` rows; from there on dequantize + matmul as below.
CPU otherwise: `aten._weight_int4pack_mm_for_cpu` below `DENSE_MIN_ROWS` rows (decode, decode
batches), always fed bf16 activations (see `KERNEL_DTYPE`); from there on (prefill) the packed
weight is dequantized into a [K, N] buffer in the engine's dtype and multiplied there: the
kernel's cost grows with rows, the dequantization's does not. The packing's layout is read off a
probe once per process (`int4_layout.py`); where it is unknown the dense path and packed row
reads are off.
CUDA: torch's tinygemm (`aten._weight_int4pack_mm`, sm80+, bf16), else dequantize + matmul.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from backends.cpu_kernels.build import active_variant
from backends.quantized import int8_dot_layout as dot_layout
from backends.quantized.affine import AffineInt4
from backends.quantized.int4_layout import Int4PackLayout, cpu_int4_layout

# From here on dequantize + matmul beats the CPU int4 kernel. Measured on 2 cores: about 48
# rows for a 2304 x 768 weight, but above 256 for a 49152-row lm_head (dequantizing it costs
# more per weight); 128 keeps decode batches on the kernel and prefill on the matmul.
DENSE_MIN_ROWS = 128
# The packed kernels take bf16 activations whatever the engine's dtype. On CPU fp32 ones cost
# 15-40x more (1 thread, rows 1 / 16 / 64, 768x2304 weight: AVX-512 3.2 / 50 / 193 ms fp32 vs
# 0.12 / 0.79 / 2.8 ms bf16; AVX2 3.4 / 49 / 196 vs 0.23 / 1.7 / 4.3 ms): the kernel does not
# use bf16 matmul hardware, so this holds where bf16 matmuls are slow, too.
KERNEL_DTYPE = torch.bfloat16
# rows() of the int8-dot layout turns float16 scales into bf16 ones inside compiled graphs:
# inductor notes the mix; it computes them in float32 all the same.
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")
# Two int8 passes per input (x ~ (q + rest / 254) * scale): the default model's logits within
# 0.012 of the dense fp32 model's in fp32 (0.42 with torch's kernel, bf16 inputs); one pass,
# llama.cpp's Q8 inputs, was 2.4 off (outlier columns share a block's scale) for ~1.8x speed.
INT8_DOT_FINE = True
# Prefill of 16 prompts (374 rows), default model: dequantize + matmul 0.54 s, the kernel 0.66.
INT8_DOT_DENSE_MIN_ROWS = 128


class Int4Linear(nn.Module):
    def __init__(
        self, weight: AffineInt4, bias: torch.Tensor | None, device: torch.device,
        dtype: torch.dtype, shards: list[int] | None = None,
    ) -> None:
        super().__init__()
        group = weight.kernel_group()
        if group is None or weight.q.shape[1] % group or weight.out_features % 16:
            raise ValueError(
                f"no int4 kernel layout for a [{weight.out_features}, {weight.in_features}] "
                f"weight with group {weight.group_size}"
            )
        weight = weight.with_group(group)
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.shards = shards or [self.out_features]
        self.group_size, self.repeats = group, weight.repeats
        self.kernel = _pick_kernel(device, dtype)
        self.dtype = dtype  # the engine's: inputs, outputs and the dequantized weight
        self.register_buffer("perm", None if weight.perm is None else weight.perm.to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        dot_scales = _int8_dot_scales(weight) if self.kernel == "cpu-int8-dot" else None
        if dot_scales is not None:
            self.kernel_dtype = dtype
            self.register_buffer("packed", dot_layout.pack(weight.q))
            self.register_buffer("scale_zeros", dot_scales)
        else:
            if self.kernel == "cpu-int8-dot":
                self.kernel = "cpu-int4pack"
            self.kernel_dtype = dtype if self.kernel == "dequantize" else KERNEL_DTYPE
            self.register_buffer("packed", _pack(weight.q, self.kernel, device))
            scale, zero = weight.scale.to(self.kernel_dtype), weight.zero.to(self.kernel_dtype)
            self.register_buffer("scale_zeros", torch.stack([scale.t(), zero.t()], -1)
                                 .contiguous().to(device))
        self.layout = _cpu_layout(self.out_features) if self.kernel == "cpu-int4pack" else None
        self.dense_ok = self.layout is not None or self.kernel == "cpu-int8-dot"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        out = self._matmul(x)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cpu-int8-dot":
            if self.repeats > 1:  # the weight's halves each see the whole input
                x = x.repeat(1, self.repeats)
            if x.shape[0] < INT8_DOT_DENSE_MIN_ROWS:
                return torch.ops.switchyard_cpu.q4_mm(
                    x.contiguous(), self.packed, self.scale_zeros, self.group_size, INT8_DOT_FINE)
            return torch.ops.switchyard_cpu.q4_dense_mm(x.contiguous(), self.packed,
                                                        self.scale_zeros, self.group_size)
        if self.kernel == "dequantize" or (
            self.kernel == "cpu-int4pack" and self.dense_ok and x.shape[0] >= DENSE_MIN_ROWS
        ):
            return x @ self.dequantize_kn().to(x.dtype)
        if self.repeats > 1:  # the weight's halves each see the whole input
            x = x.repeat(1, self.repeats)
        mm = (torch.ops.aten._weight_int4pack_mm_for_cpu if self.kernel == "cpu-int4pack"
              else torch.ops.aten._weight_int4pack_mm)
        out = mm(x.to(self.kernel_dtype), self.packed, self.group_size, self.scale_zeros)
        return out.to(x.dtype)

    def dequantize_kn(self) -> torch.Tensor:
        """The weight as [K, N] in the engine's dtype (kernel column order; halves summed)."""
        n, k = self.out_features, self.in_features * self.repeats
        if self.kernel == "cpu-int8-dot":
            return self._dequantize_int8_dot_kn(n)
        if self.kernel == "dequantize":
            q = self.packed.to(self.dtype)  # stored plain as [K, N] uint8 on this path
        elif self.layout is not None:
            q = self.layout.unpack_to(self.packed, n, k, self.dtype)
        else:
            raise RuntimeError("this CPU's int4 packing layout is unknown: no dense path")
        q = q.view(k // self.group_size, self.group_size, n)
        sz = self.scale_zeros.to(self.dtype)
        # Contiguous [G, 1, N] operands: strided ones (every other element of scale_zeros)
        # sent bf16 addcmul down a path ~8x slower.
        scale = sz[:, :, 0].contiguous()
        zero = sz[:, :, 1] - 8 * scale  # a new, contiguous tensor
        w = torch.addcmul(zero.unsqueeze(1), q, scale.unsqueeze(1)).view(k, n)
        return w if self.repeats == 1 else w.view(self.repeats, -1, n).sum(0)

    def _dequantize_int8_dot_kn(self, n: int) -> torch.Tensor:
        w = torch.ops.switchyard_cpu.q4_dequantize_kn(
            self.packed, self.scale_zeros, self.group_size, self.dtype)
        return w if self.repeats == 1 else w.view(self.repeats, -1, n).sum(0)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the dequantized weight, [len(index), in_features], read straight
        from the packed tensor (a tied embedding looks tokens up here). Needs `dense_ok`."""
        k = self.in_features * self.repeats
        if self.kernel == "cpu-int8-dot":
            q = dot_layout.rows(self.packed, index)
            scale, zero = (t.to(self.dtype).unsqueeze(-1)
                           for t in dot_layout.scale_rows(self.scale_zeros, index))
            offset = 0
        elif self.layout is not None:
            q = self.layout.rows(self.packed, index, k)  # [T, K]
            sz = self.scale_zeros[:, index].to(self.dtype)  # [G, T, 2]
            scale, zero = sz[..., 0].t().unsqueeze(-1), sz[..., 1].t().unsqueeze(-1)
            offset = 8
        else:
            raise RuntimeError("this CPU's int4 packing layout is unknown: no packed rows")
        q = q.view(len(index), -1, self.group_size).to(self.dtype)
        w = ((q - offset) * scale + zero).view(len(index), k)
        if self.repeats > 1:
            w = w.view(len(index), self.repeats, -1).sum(1)
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"kernel={self.kernel}, act_order={self.perm is not None}")


def int4_kernel_name(device: torch.device) -> str:
    return {
        "cpu-int8-dot": f"int8-dot ({active_variant()}: int8 inputs per 32 columns, two passes; "
                        f"dequantize + matmul from {INT8_DOT_DENSE_MIN_ROWS} rows)",
        "cpu-int4pack": "torch int4 weight-only mm (_weight_int4pack_mm_for_cpu, bf16 "
                        f"activations; dequantize + matmul from {DENSE_MIN_ROWS} rows)",
        "cuda-tinygemm": "torch tinygemm int4 (_weight_int4pack_mm)",
        "dequantize": "dequantize + matmul (fallback)",
    }[_pick_kernel(device, torch.bfloat16)]


def can_read_rows(out_features: int, in_features: int, device: torch.device) -> bool:
    """Will an Int4Linear of this size on `device` support `rows()`?"""
    if device.type != "cpu":
        return False
    if _pick_kernel(device, torch.float32) == "cpu-int8-dot" and dot_layout.fits(
        out_features, in_features, dot_layout.BLOCK
    ):
        return True
    return _cpu_layout(out_features) is not None


def _pick_kernel(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cpu":
        return "cpu-int8-dot" if active_variant() else "cpu-int4pack"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return "cuda-tinygemm"
    return "dequantize"


def _pack(q: torch.Tensor, kernel: str, device: torch.device) -> torch.Tensor:
    if kernel == "cpu-int4pack":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    if kernel == "cuda-tinygemm":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
        inner = next(t for t in (8, 4, 2) if q.shape[1] % (t * 16) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, inner)
    return q.t().contiguous().to(device)  # 1 byte a weight: the portable fallback


def _int8_dot_scales(weight: AffineInt4) -> torch.Tensor | None:
    """The int8-dot kernels' float16 scales and zeros, or None where the weight does not fit
    their layout or float16 cannot hold its scales."""
    if not dot_layout.fits(weight.out_features, weight.q.shape[1], weight.group_size):
        return None
    return dot_layout.pack_scales(weight.scale, weight.zero - 8 * weight.scale)


def _cpu_layout(out_features: int) -> Int4PackLayout | None:
    layout = cpu_int4_layout()
    return layout if layout is not None and layout.supports(out_features) else None
