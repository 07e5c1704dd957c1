"""bitsandbytes: nf4 / fp4 / LLM.int8, at load (`--quantize bitsandbytes[-nf4|-fp4]`) or from a
pre-quantized checkpoint as transformers saves it. The `bitsandbytes` library does the work
(its `Linear4bit` / `Linear8bitLt`), on CPU as on CUDA.

Pre-quantized tensors per linear: 4-bit `weight` (uint8 packed), `weight.absmax`,
`weight.quant_map`, `weight.quant_state.bitsandbytes__{nf4,fp4}` (+ `weight.nested_absmax`,
`weight.nested_quant_map` with double quantization); 8-bit `weight` (int8) and `SCB`.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from backends.quantized.config import BnbConfig, QuantizationError
from backends.quantized.linear import (
    LinearSpec,
    Parts,
    ShardedLinear,
    check_dtype,
    check_shape,
    fused_bias,
)

_NESTED = ("weight.nested_absmax", "weight.nested_quant_map")


def _bnb():  # imported lazily: an optional extra
    if importlib.util.find_spec("bitsandbytes") is None:
        raise QuantizationError(
            "bitsandbytes quantization needs the bitsandbytes package: "
            "pip install 'switchyard[bnb]'"
        )
    import bitsandbytes

    return bitsandbytes


class BnbLinear(nn.Module):
    """A bitsandbytes Linear, plus the sizes of fused shards and its quant-state bytes."""

    def __init__(self, inner: nn.Module, shards: list[int], kind: str) -> None:
        super().__init__()
        self.inner = inner
        self.shards = shards
        self.kernel = f"bitsandbytes {kind}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def extra_bytes(self) -> int:
        """Quantization statistics bitsandbytes keeps outside parameters and buffers."""
        weight = self.inner.weight
        state = getattr(weight, "quant_state", None)
        tensors = [getattr(weight, "SCB", None)]
        if state is not None:
            tensors += [state.absmax, state.code]
            if state.state2 is not None:
                tensors += [state.state2.absmax, state.state2.code]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class BnbWeightsLoader:
    method = "bitsandbytes"
    optional: tuple[str, ...] = ()

    def __init__(self, config: BnbConfig) -> None:
        self.config = config
        _bnb()
        if not config.prequantized:
            self.required: tuple[str, ...] = ("weight",)
        elif config.kind == "int8":
            self.required, self.optional = ("weight", "SCB"), ("weight_format",)
        else:
            self.required = ("weight", "weight.absmax", "weight.quant_map",
                             f"weight.quant_state.bitsandbytes__{config.kind}")
            if config.double_quant:
                self.required += _NESTED

    def kernel(self, device: torch.device, dtype: torch.dtype) -> str:
        return f"bitsandbytes {self.config.kind} ({device.type})"

    def build(self, spec: LinearSpec, parts: list[Parts]) -> nn.Module:
        """One bitsandbytes Linear per checkpoint projection, never fused: the library's CPU
        kernels round differently on a fused shape, and these shapes are transformers' own."""
        bias = fused_bias(spec, parts)
        offsets = [sum(spec.shards[:i]) for i in range(len(spec.shards))]
        modules = [
            self._wrap(self._one(name, p, out, spec,
                                 None if bias is None else bias[start: start + out]), [out])
            for name, p, out, start in zip(
                spec.checkpoint_names, parts, spec.shards, offsets, strict=True
            )
        ]
        return modules[0] if len(modules) == 1 else ShardedLinear(modules, spec.shards)

    def _one(
        self, name: str, parts: Parts, out: int, spec: LinearSpec, bias: torch.Tensor | None
    ) -> nn.Module:
        if not self.config.prequantized:
            check_shape(f"{name}.weight", parts["weight"], (out, spec.in_features))
            return self._at_load(parts["weight"].to(spec.dtype), bias, spec)
        if self.config.kind == "int8":
            return self._int8_prequantized(name, parts, out, spec, bias)
        return self._4bit_prequantized(name, parts, out, spec, bias)

    def _wrap(self, inner: nn.Module, shards: list[int]) -> BnbLinear:
        return BnbLinear(inner, shards, self.config.kind)

    def _at_load(self, dense: torch.Tensor, bias: torch.Tensor | None, spec: LinearSpec):
        bnb = _bnb()
        n, k = dense.shape
        if self.config.kind == "int8":
            module = bnb.nn.Linear8bitLt(k, n, bias=bias is not None, has_fp16_weights=False,
                                         threshold=self.config.threshold, device="meta")
            module.weight = bnb.nn.Int8Params(dense, requires_grad=False, has_fp16_weights=False)
        else:
            module = bnb.nn.Linear4bit(k, n, bias=bias is not None, compute_dtype=spec.dtype,
                                       quant_type=self.config.kind, device="meta")
            module.weight = bnb.nn.Params4bit(dense, requires_grad=False,
                                              quant_type=self.config.kind,
                                              blocksize=self.config.blocksize,
                                              compress_statistics=self.config.double_quant)
        return self._finish(module, bias, spec)

    def _finish(self, module: nn.Module, bias: torch.Tensor | None, spec: LinearSpec):
        if bias is not None:
            module.bias = nn.Parameter(bias.to(spec.dtype), requires_grad=False)
        return module.to(spec.device)

    def _int8_prequantized(
        self, name: str, parts: Parts, out: int, spec: LinearSpec, bias: torch.Tensor | None
    ) -> nn.Module:
        bnb = _bnb()
        check_dtype(f"{name}.weight", parts["weight"], (torch.int8,))
        check_shape(f"{name}.weight", parts["weight"], (out, spec.in_features))
        check_shape(f"{name}.SCB", parts["SCB"], (out,))
        module = bnb.nn.Linear8bitLt(spec.in_features, out, bias=bias is not None,
                                     has_fp16_weights=False, threshold=self.config.threshold,
                                     device="meta")
        weight = bnb.nn.Int8Params(parts["weight"].to(spec.device), requires_grad=False,
                                   has_fp16_weights=False)
        weight.CB = weight.data  # what Int8Params._quantize leaves behind: no .to() (it would
        weight.SCB = parts["SCB"].float().to(spec.device)  # drop them)
        module.weight = weight
        if bias is not None:
            module.bias = nn.Parameter(bias.to(spec.device, spec.dtype), requires_grad=False)
        return module

    def _4bit_prequantized(
        self, name: str, parts: Parts, out: int, spec: LinearSpec, bias: torch.Tensor | None
    ) -> nn.Module:
        bnb = _bnb()
        weight = parts["weight"]
        check_dtype(f"{name}.weight", weight, (torch.uint8,))
        check_shape(f"{name}.weight", weight, ((out * spec.in_features + 1) // 2, 1))
        stats = {k: v for k, v in parts.items() if k.startswith("weight.")}
        blocks = -(-out * spec.in_features // _blocksize(name, stats))
        absmax = stats["weight.absmax"]
        if absmax.numel() != blocks:
            raise QuantizationError(f"tensor {name}.weight.absmax: {absmax.numel()} values, "
                                    f"expected {blocks} (one per block)")
        module = bnb.nn.Linear4bit(spec.in_features, out, bias=bias is not None,
                                   compute_dtype=spec.dtype, quant_type=self.config.kind,
                                   device="meta")
        try:
            module.weight = bnb.nn.Params4bit.from_prequantized(
                weight, stats, requires_grad=False, device=spec.device, module=module
            )
        except (ValueError, KeyError, AssertionError) as exc:
            raise QuantizationError(
                f"tensor {name}.weight: bad bitsandbytes state: {exc}"
            ) from None
        return self._finish(module, bias, spec)


def _blocksize(name: str, stats: Parts) -> int:
    from bitsandbytes.utils import unpack_tensor_to_dict

    key = next(k for k in stats if "quant_state" in k)
    try:
        return int(unpack_tensor_to_dict(stats[key])["blocksize"])
    except (ValueError, KeyError) as exc:
        raise QuantizationError(f"tensor {name}.{key}: unreadable quant state ({exc})") from None
