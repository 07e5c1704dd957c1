"""Dense CPU linears through oneDNN with the weight prepacked once at load.

`F.linear` on CPU reorders (bf16: oneDNN) or blocks (fp32: MKL) the weight on every call.
Reordering it once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`, the op
inductor's `freezing` emits) and calling `mkldnn._linear_pointwise` is bit-identical in bf16
and 1.3-4x faster at 1-64 rows on both CPU kinds (bench/linear_kernels.py). The packed weight
replaces the plain one: no second copy stays resident (a tied lm_head keeps the embedding's).

The call goes through an operator that looks the packed weight up by handle (ours in C++,
cpu_kernels/prepacked_linear.cpp, where our kernels are built; else a Python custom op here),
because an opaque oneDNN tensor cannot be traced: torch.compile sees the op as a black box.
The handle is a tensor, not an int, so that one compiled decoder layer serves every layer
(compiled_step.py): a Python int on a module would be guarded, one graph per layer.

oneDNN builds (and caches, process-wide) one primitive per input row count, and each holds
0.6 MiB or more that is never given back: a server whose prefill steps take every row count
from 1 to 2048 grew by gigabytes. Rows are therefore padded up to a bounded set of counts
(`row_bucket`: exact to 16, then 8 per octave, < 12.5% padding): at most 72 primitives per
weight shape up to 2048 rows, shared by all layers (bench/linear_memory.py measures both).

Where the CPU has AVX-512-BF16, bf16 weights are packed for our own kernel instead
(`cpu_kernels/bf16_linear.cpp`, `bf16_kernel=True`; the engine's `bf16_linear_kernel`): at
every row count it is at least as fast (bench/roofline.py: oneDNN leaves the weight stream and
the multiply-adds barely overlapped at decode row counts); its sums differ from oneDNN's in
the last bf16 bit now and then. A plain tensor buffer, it needs no handle and no row buckets.
float32 weights go to our AVX2 FMA kernel the same way wherever our kernels are built
(`cpu_kernels/f32_linear.cpp`, `f32_kernel=True`; the engine's `f32_linear_kernel`): on an
AVX2-only EPYC 0.64-0.75x oneDNN's time at 1-64 rows, 0.92x at 2048; on an AVX-512 EPYC (the
same AVX2 code) 0.52-0.71x at one row, 0.8x at 16, 0.92-0.96x at 64-512. A gate /
up projection the model marks (`feeds_silu_mul`) is packed so that the kernel applies
silu(gate) * up to its sums (`silu_mul`), the MLP's activation fused into the matmul.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from backends.cpu_kernels.build import active_variant, bf16_linear_built

log = logging.getLogger(__name__)

# Row count the packing is tuned for; any count works (measured: 64 is as good as exact hints).
BATCH_HINT = 64
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

EXACT_ROWS = 16  # row counts up to this run unpadded (decode batches)

_packed_weights: list[torch.Tensor] = []  # handle -> the oneDNN tensor (one per process)


def row_bucket(rows: int) -> int:
    """The row count a matmul of `rows` rows runs at: `rows` itself up to EXACT_ROWS, then
    the next of eight evenly spaced counts per power of two."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


@torch.library.custom_op("switchyard::prepacked_linear", mutates_args=())
def prepacked_linear(
    x: torch.Tensor, handle: torch.Tensor, out_features: int, bias: torch.Tensor | None,
) -> torch.Tensor:
    weight = _packed_weights[int(handle)]
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    padded = row_bucket(count)
    if padded != count:
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
    out = _call_onednn(rows, weight, bias)
    return out[:count].reshape(*x.shape[:-1], out_features)


def _call_onednn(rows: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


def _keep(packed: torch.Tensor) -> int:
    _packed_weights.append(packed)
    return len(_packed_weights) - 1


@prepacked_linear.register_fake
def _(
    x: torch.Tensor, handle: torch.Tensor, out_features: int, bias: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PrepackedLinear(nn.Module):
    """An nn.Linear (or FusedLinear: `shards` kept) whose weight is packed once at load: for
    oneDNN, or with `bf16_kernel` / `f32_kernel` for our bf16 / float32 kernel where it runs
    (`uses_bf16_kernel`, `uses_f32_kernel`)."""

    def __init__(self, linear: nn.Module, bf16_kernel: bool = False,
                 f32_kernel: bool = False) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        shards = getattr(linear, "shards", None)
        self.shards: list[int] = list(shards) if shards else [self.out_features]
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._bytes = weight.numel() * weight.element_size()
        self.kernel = _kernel_for(weight, bf16_kernel, f32_kernel)
        # Our C++ operators where our kernels are built (no Python in the call), else this file's
        self.native = active_variant() is not None
        self.fuses_silu_mul = self.kernel != "onednn" and \
            _feeds_silu_mul(linear, self.shards, SILU_MUL_BLOCK[self.kernel])
        if self.kernel != "onednn":
            pack = PACKINGS[self.kernel, self.fuses_silu_mul]
            self.register_buffer("packed", pack(weight), persistent=False)
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)
        handle = (torch.ops.switchyard_cpu.keep_packed_weight(packed) if self.native
                  else _keep(packed))
        self.register_buffer("handle", torch.tensor(handle), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"PrepackedLinear holds {self.dtype} weights, got {x.dtype} input")
        if self.fuses_silu_mul:
            raise RuntimeError("this gate / up projection is packed for silu_mul()")
        if self.kernel == "bf16":
            return torch.ops.switchyard_cpu.bf16_linear(x, self.packed, self.bias)
        if self.kernel == "f32":
            return torch.ops.switchyard_cpu.f32_linear(x, self.packed, self.bias)
        if self.native:
            return torch.ops.switchyard_cpu.prepacked_linear(x, self.handle, self.out_features,
                                                             self.bias)
        return prepacked_linear(x, self.handle, self.out_features, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up where `fuses_silu_mul`: the kernel's tiles apply it to their sums,
        so the [rows, 2F] projection is never written and read back."""
        if self.kernel == "bf16":
            return torch.ops.switchyard_cpu.bf16_silu_mul_linear(x, self.packed)
        return torch.ops.switchyard_cpu.f32_silu_mul_linear(x, self.packed)

    def extra_bytes(self) -> int:
        """The packed weight: a non-persistent buffer or oneDNN's, so resident_bytes asks."""
        return self._bytes

    def extra_repr(self) -> str:
        packing = ("oneDNN prepacked" if self.kernel == "onednn"
                   else f"packed for our {self.kernel} kernel")
        return f"in={self.in_features}, out={self.out_features}, {self.dtype}, {packing}"


def uses_bf16_kernel(weight: torch.Tensor) -> bool:
    """Our bf16 kernel runs this weight: bf16, on a CPU with AVX-512-BF16 (and our kernels
    built), 16 output columns a block, input features in pairs."""
    rows, columns = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and \
        rows % 16 == 0 and columns % 2 == 0 and bf16_linear_built()


def _kernel_for(weight: torch.Tensor, bf16_kernel: bool, f32_kernel: bool) -> str:
    if bf16_kernel and uses_bf16_kernel(weight):
        return "bf16"
    return "f32" if f32_kernel and uses_f32_kernel(weight) else "onednn"


def _feeds_silu_mul(linear: nn.Module, shards: list[int], block: int) -> bool:
    """A gate / up projection (the model marks it) of two halves in blocks of `block`
    outputs (the kernel's tile holds a block of each)."""
    marked = bool(getattr(linear, "feeds_silu_mul", False))
    return marked and getattr(linear, "bias", None) is None and len(shards) == 2 \
        and shards[0] == shards[1] and shards[0] % block == 0


def uses_f32_kernel(weight: torch.Tensor) -> bool:
    """Our float32 kernel runs this weight: float32, on a CPU where our kernels are built (its
    AVX2 code is in both variants), 16 output columns a block."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and \
        weight.shape[0] % 16 == 0 and active_variant() is not None


def pack_for_f32_kernel(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K, 16]: 16 output columns a block, a k a 64-byte line."""
    rows, columns = weight.shape
    return weight.reshape(rows // 16, 16, columns).transpose(1, 2).contiguous()


def pack_for_f32_silu_mul(weight: torch.Tensor) -> torch.Tensor:
    """A gate / up projection [2F, K] (gate's rows first) -> [2F / 16, K, 16], block b
    holding gate's rows 8b..8b+7 then up's: the kernel's tile has both halves of its 8
    outputs of silu(gate) * up."""
    rows, columns = weight.shape
    gate, up = weight.view(2, rows // 16, 8, columns).unbind(0)
    return pack_for_f32_kernel(torch.cat([gate, up], dim=1).reshape(rows, columns))


def pack_for_bf16_kernel(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K / 2, 16, 2]: 16 output columns a block, a k-pair a 64-byte line."""
    rows, columns = weight.shape
    return weight.reshape(rows // 16, 16, columns // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_for_bf16_silu_mul(weight: torch.Tensor) -> torch.Tensor:
    """A gate / up projection [2F, K] (gate's rows first) -> [2F / 16, K / 2, 16, 2], blocks
    2j and 2j + 1 holding gate's and up's rows 16j..16j + 15: the kernel's tile (a pair of
    blocks) has both halves of its 16 outputs of silu(gate) * up."""
    rows, columns = weight.shape
    gate, up = weight.view(2, rows // 32, 16, columns).unbind(0)
    return pack_for_bf16_kernel(torch.stack([gate, up], dim=1).reshape(rows, columns))


# Our kernels' packing by (kernel, whether it fuses silu_mul).
PACKINGS = {("bf16", False): pack_for_bf16_kernel, ("bf16", True): pack_for_bf16_silu_mul,
            ("f32", False): pack_for_f32_kernel, ("f32", True): pack_for_f32_silu_mul}
# The gate outputs (and as many up outputs) a fused tile holds, by kernel.
SILU_MUL_BLOCK = {"bf16": 16, "f32": 8}


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN on a CPU, and for bf16 a CPU whose oneDNN has a bf16 path (AVX-512 or
    AVX-NE-CONVERT: an AVX2-only CPU has none, and packing would raise)."""
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES or \
            not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_linears(model: nn.Module, bf16_kernel: bool = False, f32_kernel: bool = False) -> int:
    """Swap every dense Linear / FusedLinear of `model` (not quantized ones) for a
    PrepackedLinear; returns how many. The tied embedding keeps its own plain weight."""
    targets = [(name, module) for name, module in model.named_modules()
               if _is_dense_linear(module)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = PrepackedLinear(module, bf16_kernel, f32_kernel)
        setattr(parent, attr, packed.train(module.training))
    return len(targets)


def _is_dense_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) or type(module).__name__ == "FusedLinear") and \
        isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in PACKABLE_DTYPES

