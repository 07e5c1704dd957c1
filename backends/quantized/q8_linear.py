"""Q8Linear: 8-bit weights with one scale per 32 input columns (GGUF Q8_0: w = q * scale) for
our kernel (`cpu_kernels/q8_dot.cpp`): inputs as int16 per 32 columns, products summed exactly
in int32 per block (AVX2 `vpmaddwd`, AVX-512 VNNI `vpdpwssd`), a single pass over 1.06 bytes a
weight; from DENSE_MIN_ROWS rows (prefill) the weight dequantized in C++ a cache-sized slice at
a time, each slice multiplied by torch's matmul.

It replaced two int4 halves in an Int4Linear (`AffineInt8.as_int4_halves`: 1.25 bytes a weight,
four int8 passes with the fine inputs). On the AVX2 EPYC the default model's Q8_0 lm_head
(49152 x 576) took 1.43 ms from memory against 1.95 ms as halves at one row, 5.7 vs 11.8 ms at
16, and came closer to the float64 product (max error 4.3e-3 vs 5.4e-3 with an outlier column).
"""

from __future__ import annotations

import torch
from torch import nn

from backends.cpu_kernels.build import active_variant

LANES = 16  # output rows of a packed block
BLOCK = 32  # input columns of one weight scale (and one input scale)
STEP = 4  # input columns of a lane in one packed line
# From here on dequantizing (in cache-sized slices) + matmul beats the kernel. bf16: 48-64 rows
# on the AMX Xeon (2 threads, a ~1.5B model's shapes). float32's matmul is slower: at 128 rows
# the default model's lm_head took 27 ms on the kernel, 36 dense.
DENSE_MIN_ROWS = {torch.bfloat16: 64, torch.float32: 256}


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether our kernel runs on `device` with `dtype` activations."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and \
        active_variant() is not None


def runs_here(out_features: int, in_features: int, device: torch.device,
              dtype: torch.dtype) -> bool:
    """Whether a weight of this shape can be a Q8Linear on `device`."""
    return out_features % LANES == 0 and in_features % BLOCK == 0 and available(device, dtype)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N / 16, K / 4, 16, 4]: a line holds 4 columns of 16 rows."""
    n, k = q.shape
    return q.view(n // LANES, LANES, k // STEP, STEP).permute(0, 2, 1, 3).contiguous()


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """float [N, K / 32] -> float16 [N / 16, K / 32, 16]."""
    n, groups = scale.shape
    return scale.view(n // LANES, LANES, groups).permute(0, 2, 1).to(torch.float16).contiguous()


class Q8Linear(nn.Module):
    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
        device: torch.device, dtype: torch.dtype, shards: list[int] | None = None,
    ) -> None:
        """q: int8 [N, K]; scale: [N, K / 32], exact in float16 (GGUF stores it so)."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.shards = shards or [self.out_features]
        self.dtype = dtype
        self.register_buffer("packed", pack(q).to(device))
        self.register_buffer("scales", pack_scales(scale).to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.shape[0] < DENSE_MIN_ROWS[x.dtype]:
            out = torch.ops.switchyard_cpu.q8_mm(x.contiguous(), self.packed, self.scales)
        else:
            out = torch.ops.switchyard_cpu.q8_dense_mm(x.contiguous(), self.packed, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the weight, [len(index), in_features] in the engine's dtype (a tied
        embedding looks tokens up here)."""
        q = self.packed[index // LANES, :, index % LANES]  # [T, K / 4, 4]
        scale = self.scales[index // LANES, :, index % LANES]  # [T, K / 32]
        values = q.reshape(len(index), -1, BLOCK).to(self.dtype) * \
            scale.to(self.dtype).unsqueeze(-1)
        return values.view(len(index), self.in_features)

    def dense(self) -> torch.Tensor:
        """The weight as [N, K] in the engine's dtype."""
        return torch.ops.switchyard_cpu.q8_dequantize(self.packed, self.scales, self.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={BLOCK}, "
                "kernel=cpu-q8-dot")


def q8_kernel_name() -> str:
    return f"q8-dot (int16 inputs per {BLOCK} columns; dequantize + matmul from " \
           f"{DENSE_MIN_ROWS[torch.bfloat16]} rows in bf16, {DENSE_MIN_ROWS[torch.float32]} " \
           "in float32)"
