"""Q8Linear: 8-bit weights with one scale per 32 input columns (GGUF Q8_0: w = q * scale) for
our AVX2 kernel (`cpu_kernels/q8_dot.cpp`: inputs as int16 per 32 columns, one `vpmaddwd` per
16 weights, a single pass).

Taken where our kernels run their AVX2 code. Elsewhere Q8_0 stays two int4 halves in an
Int4Linear (`AffineInt8.as_int4_halves`): on AVX-512 `q4_mm`'s VNNI path runs those, and this
kernel is unmeasured there. On the AVX2 EPYC the default model's Q8_0 lm_head (49152 x 576)
took 1.43 ms from memory against 1.95 ms as halves at one row, 5.7 vs 11.8 ms at 16, and came
closer to the float64 product (max error 4.3e-3 vs 5.4e-3 with an outlier column).
"""

from __future__ import annotations

import torch
from torch import nn

from backends.cpu_kernels.build import active_variant

LANES = 16  # output rows of a packed block
BLOCK = 32  # input columns of one weight scale (and one input scale)
STEP = 4  # input columns of a lane in one packed line
# From here on widening the weight and multiplying beats the kernel (as Int4Linear's
# INT8_DOT_DENSE_MIN_ROWS): the lm_head rarely sees this many rows.
DENSE_MIN_ROWS = 128


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether our kernel runs on `device` with `dtype` activations."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and \
        active_variant() == "avx2"


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
        if x.shape[0] < DENSE_MIN_ROWS:
            out = torch.ops.switchyard_cpu.q8_mm(x.contiguous(), self.packed, self.scales)
        else:
            out = x @ self.dense().t()
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
        q = self.packed.permute(0, 2, 1, 3).reshape(self.out_features, -1, BLOCK)
        scale = self.scales.permute(0, 2, 1).reshape(self.out_features, -1, 1)
        return (q.to(self.dtype) * scale.to(self.dtype)).view(self.out_features, -1)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={BLOCK}, "
                "kernel=cpu-q8-dot")


def q8_kernel_name() -> str:
    return f"q8-dot (AVX2: int16 inputs per {BLOCK} columns; widen + matmul from " \
           f"{DENSE_MIN_ROWS} rows)"
