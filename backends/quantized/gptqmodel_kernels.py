"""GPTQ and AWQ Linears on gptqmodel's kernels (an optional extra: `pip install gptqmodel`).

gptqmodel names the QuantLinear classes that take a layout on a device, fastest first
(`select_quant_linear`): on CUDA Marlin / ExLlamaV2 / Machete for GPTQ, Marlin / GEMM / ExLlamaV2
for AWQ; on CPU its ATen int4 kernels and a plain torch dequantization. A Linear's checkpoint
tensors go into that class's buffers as gptqmodel's own loader puts them (GPTQ v1 zero points
converted to its v2 convention for the classes that need it), then `post_init()` packs them.
`--quantized-kernels`: auto (these on CUDA where one fits, else native), native, gptqmodel.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from backends.quantized.config import QuantizationError, check_kernels_setting
from backends.quantized.linear import LinearSpec, Parts, ShardedLinear

log = logging.getLogger(__name__)

# Never used: their CPU path drops zero points (wrong on asym weights) and turns on
# torch._inductor.config.freezing / max_autotune for the whole process.
_UNFIT = frozenset({"TorchFusedLinear", "TorchFusedAwqLinear"})
_BUFFERS = ("qweight", "qzeros", "scales", "g_idx", "bias")


@dataclass(frozen=True)
class Layout:
    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group over all inputs
    sym: bool
    desc_act: bool

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.method} {self.bits}-bit {group} {'sym' if self.sym else 'asym'}"


def _import_gptqmodel() -> SimpleNamespace:
    """The lazy import (gptqmodel takes seconds to import); tests replace this hook."""
    from gptqmodel.models._const import DEVICE
    from gptqmodel.quantization import FORMAT, METHOD
    from gptqmodel.utils.backend import BACKEND
    from gptqmodel.utils.importer import select_quant_linear, validate_quant_linear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

    return SimpleNamespace(
        DEVICE=DEVICE, FORMAT=FORMAT, METHOD=METHOD, BACKEND=BACKEND,
        select_quant_linear=select_quant_linear, validate_quant_linear=validate_quant_linear,
        v1_to_v2=convert_gptq_v1_to_v2_format_module,
    )


def gptqmodel_api() -> SimpleNamespace:
    try:
        return _import_gptqmodel()
    except ImportError as exc:
        raise QuantizationError(
            f"gptqmodel's kernels: gptqmodel cannot be imported ({exc}); install it "
            "(pip install gptqmodel) or use --quantized-kernels native"
        ) from None


def candidates(layout: Layout, device: torch.device, dtype: torch.dtype) -> list[type]:
    """gptqmodel's classes for `layout` on `device`, in its order of preference."""
    api = gptqmodel_api()
    gptq = layout.method == "gptq"
    try:
        found = api.select_quant_linear(
            layout.bits, layout.group_size, layout.desc_act, layout.sym, device,
            backend=api.BACKEND.AUTO, format=api.FORMAT.GPTQ if gptq else api.FORMAT.GEMM,
            quant_method=api.METHOD.GPTQ if gptq else api.METHOD.AWQ,
            pack_dtype=torch.int32, dtype=dtype, multi_select=True,
        )
    except (ValueError, NotImplementedError, ImportError, RuntimeError) as exc:
        found, reason = [], str(exc)
    else:
        reason = "only " + ", ".join(c.__name__ for c in found)
    fit = [c for c in found if c.__name__ not in _UNFIT]
    if not fit:
        raise QuantizationError(
            f"gptqmodel has no kernel for {layout.describe()} on {device.type} in "
            f"{str(dtype).removeprefix('torch.')} ({reason})"
        )
    return fit


class KernelChoice:
    """The `--quantized-kernels` setting for one checkpoint's layout: the gptqmodel classes to
    build with on a device, or None for the native kernels; resolved once per device."""

    def __init__(self, setting: str, layout: Layout) -> None:
        self.setting = check_kernels_setting(setting)
        self.layout = layout
        self._resolved: dict[tuple[torch.device, torch.dtype], list[type] | None] = {}

    def classes(self, device: torch.device, dtype: torch.dtype) -> list[type] | None:
        key = (device, dtype)
        if key not in self._resolved:
            self._resolved[key] = self._resolve(device, dtype)
        return self._resolved[key]

    def _resolve(self, device: torch.device, dtype: torch.dtype) -> list[type] | None:
        if self.setting == "native" or (self.setting == "auto" and device.type != "cuda"):
            return None  # on CPU the native int4 / int8 kernels measured faster
        if self.setting == "gptqmodel":
            return candidates(self.layout, device, dtype)
        try:
            found = candidates(self.layout, device, dtype)
        except QuantizationError as exc:
            log.info("%s; native kernels instead", exc)
            return None
        api = gptqmodel_api()
        cuda = [c for c in found if api.DEVICE.CUDA in c.SUPPORTS_DEVICES]  # not generic torch
        return cuda or None

    def describe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        classes = self.classes(device, dtype)
        return None if classes is None else f"gptqmodel {classes[0].__name__}"

    def build_checked(
        self, spec: LinearSpec, parts: list[Parts], bias: torch.Tensor | None,
        check: Callable[[str, Parts, int, int], object],
    ) -> nn.Module | None:
        """`build`, after `check(name, parts, out_features, in_features)` passed each shard
        (only when gptqmodel's kernels are chosen: the native path checks as it reads)."""
        if self.classes(spec.device, spec.dtype) is None:
            return None
        for name, shard, out in zip(spec.checkpoint_names, parts, spec.shards, strict=True):
            check(name, shard, out, spec.in_features)
        return self.build(spec, parts, bias)

    def build(self, spec: LinearSpec, parts: list[Parts], bias: torch.Tensor | None
              ) -> nn.Module | None:
        """gptqmodel's Linear for `spec` (checked tensors), or None for the native kernels:
        where the setting says so, or, under auto, where no gptqmodel class takes a shape."""
        classes = self.classes(spec.device, spec.dtype)
        if classes is None:
            return None
        try:
            return build_linear(classes, self.layout, spec, parts, bias)
        except QuantizationError as exc:
            if self.setting == "gptqmodel":
                raise
            log.warning("%s; the native kernel instead", exc)
            return None


class GPTQModelLinear(nn.Module):
    """One gptqmodel QuantLinear, as the engine calls Linears: [T, in_features] in its dtype."""

    def __init__(self, qlinear: nn.Module, shards: list[int], scratch: Any = None) -> None:
        super().__init__()
        self.qlinear = qlinear
        self.shards = shards
        self.in_features, self.out_features = qlinear.in_features, qlinear.out_features
        self.kernel = f"gptqmodel {type(qlinear).__name__}"
        self._scratch = scratch  # ExLlamaV2's shared scratch: its kernels keep raw pointers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.qlinear(x.reshape(-1, shape[-1]))
        return out.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_bytes(self) -> int:
        """Tensors the kernel keeps as plain attributes (packed copies made by its transform)."""
        counted = {t.untyped_storage().data_ptr() for t in (*self.parameters(), *self.buffers())}
        total = 0
        for module in self.qlinear.modules():
            for value in vars(module).values():
                if isinstance(value, torch.Tensor):
                    storage = value.untyped_storage()
                    if storage.data_ptr() not in counted:
                        counted.add(storage.data_ptr())
                        total += storage.nbytes()
        return total


def build_linear(
    classes: list[type], layout: Layout, spec: LinearSpec, parts: list[Parts],
    bias: torch.Tensor | None,
) -> nn.Module:
    """One QuantLinear over all shards when they can share one (same g_idx, whole packed
    words), else one per shard. `parts` are checked checkpoint tensors, one dict per shard."""
    fused = _fuse(layout, parts, spec.shards)
    if fused is not None:
        tensors = {**fused, "bias": bias}
        return _linear(classes, layout, spec, spec.name, tensors, spec.shards)
    log.info("%s: shards differ in act order (or split packed words); one gptqmodel Linear "
             "per shard", spec.name)
    offsets = [sum(spec.shards[:i]) for i in range(len(spec.shards))]
    modules = [
        _linear(classes, layout, spec, f"{spec.name}[{i}]",
                {**_own(layout, p), "bias": None if bias is None else bias[o: o + n]}, [n])
        for i, (p, o, n) in enumerate(zip(parts, offsets, spec.shards, strict=True))
    ]
    sharded = ShardedLinear(modules, spec.shards)
    sharded.kernel = modules[0].kernel
    return sharded


def _own(layout: Layout, parts: Parts) -> dict[str, torch.Tensor | None]:
    keys = ("qweight", "qzeros", "scales") + (("g_idx",) if layout.method == "gptq" else ())
    return {k: parts.get(k) for k in keys}


def _fuse(layout: Layout, parts: list[Parts], shards: list[int]) -> dict | None:
    if len(parts) == 1:
        return _own(layout, parts[0])
    per_word = 32 // layout.bits
    if layout.method == "gptq":
        g_idx = [p.get("g_idx") for p in parts]
        same = all(g is None for g in g_idx) or all(
            g is not None and torch.equal(g, g_idx[0]) for g in g_idx
        )
        if not same or any(n % per_word for n in shards):
            return None
    cat = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("qweight", "qzeros", "scales")}
    return {**cat, "g_idx": parts[0].get("g_idx")} if layout.method == "gptq" else cat


def _linear(
    classes: list[type], layout: Layout, spec: LinearSpec, name: str, tensors: dict,
    shards: list[int],
) -> GPTQModelLinear:
    api = gptqmodel_api()
    k, n = spec.in_features, sum(shards)
    group = k if layout.group_size == -1 else layout.group_size
    if layout.method == "gptq" and tensors["g_idx"] is None:
        tensors["g_idx"] = torch.arange(k, dtype=torch.int32) // group
    desc_act = layout.desc_act or (
        layout.method == "gptq" and not torch.equal(tensors["g_idx"].cpu().int(), _plain(k, group))
    )
    device = _indexed(spec.device)
    options = {"bits": layout.bits, "group_size": layout.group_size, "desc_act": desc_act,
               "sym": layout.sym, "pack_dtype": torch.int32, "dtype": spec.dtype}
    refused = []
    for cls in classes:
        ok, err = api.validate_quant_linear(cls, **options, in_features=k, out_features=n,
                                            device=device)
        if not ok:
            refused.append(f"{cls.__name__}: {err}")
            continue
        try:
            with torch.device("cpu"):
                qlinear = cls(**options, in_features=k, out_features=n,
                              bias=tensors["bias"] is not None, name=name,
                              backend=api.BACKEND.AUTO, register_buffers=True, adapter=None)
        except (NotImplementedError, ValueError) as exc:
            refused.append(f"{cls.__name__}: {exc}")
            continue
        if cls is not classes[0]:
            log.info("%s: [%d, %d] does not fit %s; %s instead", name, n, k,
                     classes[0].__name__, cls.__name__)
        return _load(api, qlinear, layout, tensors, device, spec.dtype, shards)
    raise QuantizationError(
        f"{name}: no gptqmodel kernel takes a [{n}, {k}] {layout.describe()} weight on "
        f"{device.type}: " + "; ".join(refused)
    )


def _plain(k: int, group: int) -> torch.Tensor:
    return (torch.arange(k) // group).to(torch.int32)


def _indexed(device: torch.device) -> torch.device:
    """gptqmodel's CUDA kernels want an explicit device index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _load(
    api: SimpleNamespace, qlinear: nn.Module, layout: Layout, tensors: dict,
    device: torch.device, dtype: torch.dtype, shards: list[int],
) -> GPTQModelLinear:
    # Copies: the kernels edit some in place (v1 -> v2 zero points). Scales keep the
    # checkpoint's dtype, as transformers' GPTQ / AWQ loading leaves them (each kernel casts
    # them as it needs): bf16-rounded scales move TorchLinear off the reference's results.
    for key in _BUFFERS:
        if tensors.get(key) is not None:
            tensor = tensors[key]
            cast = dtype if key == "bias" else torch.int32 if key == "g_idx" else None
            _put(qlinear, key, tensor.to(device, cast, copy=True))
    qlinear.to(device)  # whatever the constructor made beside them
    if layout.method == "gptq" and getattr(qlinear, "REQUIRES_FORMAT_V2", False):
        api.v1_to_v2(qlinear, bits=layout.bits, pack_dtype=torch.int32)  # zero points + 1
    scratch = None
    if "scratch_space" in inspect.signature(qlinear.post_init).parameters:
        scratch = _scratch(device, qlinear.temp_dq_size())
        qlinear.post_init(scratch_space=scratch)
    else:
        qlinear.post_init()
    qlinear.eval()
    module = GPTQModelLinear(qlinear, shards, scratch)
    with torch.no_grad():  # kernels that repack on first use (CPU ATen int4) do it now
        module(torch.zeros(1, qlinear.in_features, device=device, dtype=dtype))
    return module


def _put(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[name] = tensor


_SCRATCH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _scratch(device: torch.device, size: int) -> Any:
    """ExLlamaV2's dequantization scratch, shared by every Linear on a device (as gptqmodel
    shares it); a larger one is made when a Linear needs more (older ones stay referenced)."""
    scratch = _SCRATCH.get(device)
    if scratch is None or scratch.scratch_bytes < size:
        scratch = _scratch_space_class()(scratch_bytes=size, dev=device)
        _SCRATCH[device] = scratch
    return scratch


@functools.cache
def _scratch_space_class() -> type:
    from gptqmodel.utils.exllamav2 import ScratchSpace

    return ScratchSpace
