"""KQuantLinear: GGUF Q5_0 / Q5_1 / Q5_K / Q6_K weights repacked once at load from the file's
blocks into our kernel's layout (`cpu_kernels/kquant_dot.cpp`'s `kquant_pack`: per segment of
columns, a 4-bit plane and a 2- or 1-bit plane interleaved for the SIMD lanes and the blocks'
own scale bytes: the file's bytes for Q5_0 / Q5_1 / Q6_K, up to 3% more for Q5_K / Q4_K
(6% on AVX2)), multiplied by `kquant_packed_mm` with no
decoding per call: inputs quantized per 32 columns in two int8 passes as Int4Linear's
`INT8_DOT_FINE`, integer dot products. The products and dequantization are exactly those of
the file's blocks. The layout depends on the kernels' build variant (the weight cache's entry
names it).

Below `DENSE_MIN_ROWS` input rows (decode, decode batches, short prompts) the kernel runs;
from there on (prefill) the kernel dequantizes the whole weight in the engine's dtype and the
product is one matmul: the kernel's cost grows with rows, the dequantization's does not.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from backends.cpu_kernels.build import active_variant

T = GGMLQuantizationType
# Types the kernel takes on their own layout (Q4_K too, though Q4_K stays an Int4Linear:
# gguf.py says why).
KERNEL_TYPES = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q4_K)
# Where dequantize + matmul overtakes the kernel (bench/quantized.py's kquant rows).
DENSE_MIN_ROWS = 64


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether our kernel runs on `device` with `dtype` activations."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and \
        active_variant() is not None


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cpu":
        return f"no kernel for it on {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"no kernel for {str(dtype).removeprefix('torch.')} activations"
    return "our CPU kernels do not run here (see cpu_kernels in /info)"


class KQuantLinear(nn.Module):
    def __init__(
        self, blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
        bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
        shards: list[int] | None = None,
    ) -> None:
        """blocks: uint8 [N, row bytes], the GGUF tensor's rows (fused shards concatenated);
        kept repacked (`packed`)."""
        super().__init__()
        self.qtype = int(qtype)
        self.type_name = qtype.name
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.shards = shards or [self.out_features]
        self.dtype = dtype
        if not available(device, dtype):  # also loads our kernels' operators
            raise RuntimeError(f"KQuantLinear: {unavailable_reason(device, dtype)}")
        packed = torch.ops.switchyard_cpu.kquant_pack(blocks.contiguous().cpu(), self.qtype,
                                                      in_features)
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.shape[0] < DENSE_MIN_ROWS:
            out = torch.ops.switchyard_cpu.kquant_packed_mm(x.contiguous(), self.packed,
                                                            self.qtype, self.in_features)
        else:
            out = torch.ops.switchyard_cpu.kquant_dense_mm(x.contiguous(), self.packed,
                                                           self.qtype, self.in_features)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the weight in the engine's dtype (a tied embedding's lookups)."""
        return torch.ops.switchyard_cpu.kquant_packed_dequantize(
            self.packed[index], self.qtype, self.in_features, self.dtype)

    def dense(self) -> torch.Tensor:
        """The weight as [N, K] in the engine's dtype."""
        return torch.ops.switchyard_cpu.kquant_packed_dequantize(
            self.packed, self.qtype, self.in_features, self.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, type={self.type_name}, "
                "kernel=cpu-kquant-dot")


def kquant_kernel_name() -> str:
    return ("kquant-dot (the file's blocks repacked for the SIMD lanes, int8 inputs per 32 "
            f"columns; dequantize + matmul from {DENSE_MIN_ROWS} rows)")
