"""Int8Linear: int8 weights, one symmetric scale per output channel (EETQ, 8-bit per-channel).

CPU: `torch._weight_int8pack_mm` for few rows, fed bf16 activations whatever the engine's
dtype (`KERNEL_DTYPE`); from `DENSE_MIN_ROWS` rows on, the int8 weight is widened to the
engine's dtype and multiplied, the per-channel scale applied to the output.
CUDA: the `eetq` package's w8a16 GEMM when installed, else widen + matmul.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

DENSE_MIN_ROWS = 32  # from here on widening + matmul beats the int8 kernel (measured)
# fp32 activations cost the CPU kernel 7-25x more than bf16 ones (1 thread, 768x2304 weight,
# rows 1 / 16 / 64: AVX-512 1.4 / 24 / 96 ms vs 0.09 / 0.75 / 3.0 ms; AVX2 1.4 / 24 / 95 vs
# 0.11 / 0.94 / 3.8 ms), so it gets bf16 ones and the per-channel scale in bf16.
KERNEL_DTYPE = torch.bfloat16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: w ~= q * scale, q in -127..127."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
        device: torch.device, dtype: torch.dtype, shards: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.shards = shards or [self.out_features]
        self.kernel = _pick_kernel(device)
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        self.register_buffer(
            "scale", scale.to(device, KERNEL_DTYPE if self.kernel == "cpu-int8pack" else dtype)
        )
        if self.kernel == "cuda-eetq":
            from EETQ import quant_weights  # type: ignore[import-not-found]

            dense = (q.float() * scale[:, None]).to(torch.float16)
            packed, eetq_scale = quant_weights(dense.t().contiguous().cpu(), torch.int8, False)
            self.register_buffer("q", packed.to(device))
            self.register_buffer("eetq_scale", eetq_scale.to(device, torch.float16))
        else:
            self.register_buffer("q", q.contiguous().to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.kernel == "cpu-int8pack" and x.shape[0] < DENSE_MIN_ROWS:
            out = torch._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.q, self.scale).to(x.dtype)
        elif self.kernel == "cuda-eetq":
            from EETQ import w8_a16_gemm  # type: ignore[import-not-found]

            out = w8_a16_gemm(x.half(), self.q, self.eetq_scale).to(x.dtype)
        else:
            out = nn.functional.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


def int8_kernel_name(device: torch.device) -> str:
    return {
        "cpu-int8pack": "torch int8 weight-only mm (_weight_int8pack_mm, bf16 activations; "
                        f"widen + matmul from {DENSE_MIN_ROWS} rows)",
        "cuda-eetq": "eetq w8a16 GEMM",
        "dequantize": "widen int8 + matmul (fallback)",
    }[_pick_kernel(device)]


def _pick_kernel(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu-int8pack"
    if device.type == "cuda" and importlib.util.find_spec("EETQ") is not None:
        return "cuda-eetq"
    return "dequantize"
