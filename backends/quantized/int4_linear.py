"""Int4Linear: 4-bit weights packed for torch's weight-only int4 kernels.

CPU: `aten._weight_int4pack_mm_for_cpu` below `DENSE_MIN_ROWS` rows (decode, decode batches);
from there on (prefill) the packed weight is dequantized into a bf16 [K, N] buffer and
multiplied there: the kernel's cost grows with rows, the dequantization's does not, and at
prefill sizes the dequantize + bf16 matmul is several times faster.
CUDA: torch's tinygemm (`aten._weight_int4pack_mm`, sm80+, bf16), else dequantize + matmul.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from backends.quantized.affine import AffineInt4

# From here on dequantize + matmul beats the CPU int4 kernel. Measured on 2 cores: about 48
# rows for a 2304 x 768 weight, but above 256 for a 49152-row lm_head (dequantizing it costs
# more per weight); 128 keeps decode batches on the kernel and prefill on the matmul.
DENSE_MIN_ROWS = 128
_BLOCK_N = 64  # the CPU packing's row block on AVX-512 machines (checked at run time)


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
        self.compute_dtype = torch.bfloat16 if self.kernel == "cuda-tinygemm" else dtype
        self.register_buffer("perm", None if weight.perm is None else weight.perm.to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        self.register_buffer("packed", _pack(weight.q, self.kernel, device))
        scale, zero = weight.scale.to(self.compute_dtype), weight.zero.to(self.compute_dtype)
        self.register_buffer("scale_zeros", torch.stack([scale.t(), zero.t()], -1).contiguous()
                             .to(device))
        self.dense_ok = self.kernel == "cpu-int4pack" and _cpu_layout_known(self.out_features)

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
        if self.kernel == "dequantize" or (
            self.kernel == "cpu-int4pack" and self.dense_ok and x.shape[0] >= DENSE_MIN_ROWS
        ):
            return x @ self.dequantize_kn().to(x.dtype)
        if self.repeats > 1:  # the weight's halves each see the whole input
            x = x.repeat(1, self.repeats)
        if self.kernel == "cpu-int4pack":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group_size, self.scale_zeros
            )
        out = torch.ops.aten._weight_int4pack_mm(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zeros
        )
        return out.to(x.dtype)

    def dequantize_kn(self) -> torch.Tensor:
        """The weight as [K, N] in the compute dtype (kernel column order; halves summed)."""
        n, k = self.out_features, self.in_features * self.repeats
        if self.kernel == "dequantize":
            q = self.packed  # stored plain as [K, N] uint8 on this path
        else:
            b = self.packed.view(n // _BLOCK_N, k, _BLOCK_N // 2)
            q = torch.cat([b & 15, b >> 4], -1).permute(1, 0, 2).reshape(k, n)
        q = q.reshape(k // self.group_size, self.group_size, n).to(self.compute_dtype)
        scale = self.scale_zeros[:, :, 0].unsqueeze(1)  # [G, 1, N]
        zero = self.scale_zeros[:, :, 1].unsqueeze(1) - 8 * scale
        w = torch.addcmul(zero, q, scale).view(k, n)
        return w if self.repeats == 1 else w.view(self.repeats, -1, n).sum(0)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the dequantized weight, [len(index), in_features], read straight
        from the packed tensor (a tied embedding looks tokens up here). Needs `dense_ok`."""
        k = self.in_features * self.repeats
        blocks = self.packed.view(self.out_features // _BLOCK_N, k, _BLOCK_N // 2)
        local = index % _BLOCK_N
        picked = blocks[index // _BLOCK_N, :, local % (_BLOCK_N // 2)]  # [T, K] bytes
        q = (picked >> (4 * (local // (_BLOCK_N // 2))).unsqueeze(1)) & 15
        sz = self.scale_zeros[:, index]  # [G, T, 2]
        scale, zero = sz[..., 0].t().unsqueeze(-1), sz[..., 1].t().unsqueeze(-1)
        q = q.view(len(index), -1, self.group_size).to(self.compute_dtype)
        w = ((q - 8) * scale + zero).view(len(index), k)
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
        "cpu-int4pack": "torch int4 weight-only mm (_weight_int4pack_mm_for_cpu; "
                        f"dequantize + bf16 matmul from {DENSE_MIN_ROWS} rows)",
        "cuda-tinygemm": "torch tinygemm int4 (_weight_int4pack_mm)",
        "dequantize": "dequantize + matmul (fallback)",
    }[_pick_kernel(device, torch.bfloat16)]


def can_read_rows(out_features: int, device: torch.device) -> bool:
    """Will an Int4Linear of this size on `device` support `rows()`?"""
    return device.type == "cpu" and _cpu_layout_known(out_features)


def _pick_kernel(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cpu":
        return "cpu-int4pack"
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


@functools.cache
def _cpu_block64_layout() -> bool:
    """Does this CPU's int4 packing use the 64-row blocks `dequantize_kn` reads?"""
    q = torch.randint(0, 16, (_BLOCK_N * 2, 64), generator=torch.Generator().manual_seed(0),
                      dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    b = packed.view(2, 64, _BLOCK_N // 2)
    unpacked = torch.cat([b & 15, b >> 4], -1).permute(0, 2, 1).reshape(q.shape)
    return torch.equal(unpacked.to(torch.int32), q)


def _cpu_layout_known(out_features: int) -> bool:
    return out_features % _BLOCK_N == 0 and _cpu_block64_layout()

