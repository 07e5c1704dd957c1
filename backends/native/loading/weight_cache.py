"""Built GGUF weights, cached: the packed int4 modules and the dense tensors of a loaded model.

Unpacking GGUF blocks and repacking them for torch's int4 kernel is most of a GGUF load. The
result is saved once as a safetensors file plus a manifest naming, for each quantized Linear,
its module class (only classes of `backends.quantized`) and its plain attributes. A start with
the entry rebuilds the same modules without running their constructors: no pickle, nothing
executed from the cache.

The packing layout depends on the CPU's ISA, the torch version and whether the int8-dot
kernels run here, the modules on the engine's code: `variant()` puts all of them in the
entry's name.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from backends.cpu_kernels.build import active_variant
from backends.quantized.loading import QuantizedLinears

FORMAT = 1
_ALLOWED_CLASS_PREFIX = "backends.quantized."
_MODULE_LIST = "torch.nn.modules.container.ModuleList"
_MAX_INLINE_TENSOR = 4096  # elements: small attribute tensors (a layout's row map) go inline
_CODE_DIRS = ("backends/quantized", "backends/native/models")
_ROOT = Path(__file__).resolve().parents[3]  # the folder that holds backends/


class NotCacheable(ValueError):
    """A built module the manifest cannot describe (it loads uncached)."""


def variant(device: torch.device, dtype: torch.dtype, settings: str) -> str:
    """The entry name for this machine, torch, engine code and load settings."""
    facts = [
        str(FORMAT), torch.__version__, torch.backends.cpu.get_cpu_capability(), str(device),
        str(dtype), settings, _code_fingerprint(), str(active_variant()),
    ]
    return "weights-" + hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def save(folder: Path, model: nn.Module, linears: QuantizedLinears | None) -> None:
    """Write the loaded model's weights and the quantized modules' manifest into `folder`."""
    built = linears.built if linears else {}
    modules = {name: _describe(module) for name, module in built.items()}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    # the built modules' non-persistent buffers too: they are rebuilt from the entry alone
    extra = {f"{prefix}.{name}": t for prefix, module in built.items()
             for name, t in module.named_buffers()}
    for name, tensor in {**model.state_dict(), **extra}.items():
        if tensor.numel() and tensor.data_ptr() in seen:  # tied: the skeleton ties them again
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(folder / "state.safetensors"))
    (folder / "manifest.json").write_text(json.dumps({"format": FORMAT, "modules": modules}))


def restore(
    folder: Path, model: nn.Module, linears: QuantizedLinears | None, device: torch.device,
) -> None:
    """Fill the freshly built skeleton (placeholders where quantized Linears go) from `folder`,
    on `device`. Raises on any mismatch between the entry and the skeleton."""
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"manifest format {manifest.get('format')} != {FORMAT}")
    tensors = {name: _aligned(t) for name, t in
               load_file(str(folder / "state.safetensors"), device=str(device)).items()}
    expected = set(linears.specs) if linears else set()
    if set(manifest["modules"]) != expected:
        raise ValueError("the entry's quantized modules differ from the model's")
    for name, node in manifest["modules"].items():
        _set_submodule(model, name, _rebuild(node, name, tensors))
    _copy_dense(model, tensors, set(manifest["modules"]))


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` where it starts on a 64-byte boundary, else a copy that does (as every fresh
    allocation): safetensors hands out views at the file's offsets, and float32 GEMVs sum in
    another order over an unaligned weight (a cached load's logits differed in the last bits)."""
    return tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()


def _describe(module: nn.Module) -> dict[str, Any]:
    cls = type(module)
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    if not qualified.startswith(_ALLOWED_CLASS_PREFIX) and qualified != _MODULE_LIST:
        raise NotCacheable(f"module class {qualified}")
    attrs = {k: _encode(k, v) for k, v in vars(module).items() if k not in _module_internals()}
    return {
        "class": qualified,
        "attrs": attrs,
        "buffers": {k: v is not None for k, v in module._buffers.items()},
        "non_persistent": sorted(module._non_persistent_buffers_set),
        "params": sorted(module._parameters),
        "children": {k: _describe(child) for k, child in module._modules.items()
                     if child is not None},
    }


def _rebuild(node: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor]) -> nn.Module:
    cls = _allowed_class(node["class"])
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for key, value in node["attrs"].items():
        object.__setattr__(module, key, _decode(value))
    for name, present in node["buffers"].items():
        tensor = tensors.pop(f"{prefix}.{name}") if present else None
        module.register_buffer(name, tensor, persistent=name not in node["non_persistent"])
    for name in node["params"]:
        module.register_parameter(name, nn.Parameter(tensors.pop(f"{prefix}.{name}"), False))
    for name, child in node["children"].items():
        module.add_module(name, _rebuild(child, f"{prefix}.{name}", tensors))
    return module


def _copy_dense(model: nn.Module, tensors: dict[str, torch.Tensor], rebuilt: set[str]) -> None:
    """The rest (norms, dense embeddings) into the skeleton's own tensors; tied ones share."""
    state = {name: t for name, t in model.state_dict(keep_vars=True).items()
             if not _under(name, rebuilt)}
    unknown = sorted(set(tensors) - set(state))
    if unknown:
        raise ValueError(f"the entry holds tensors the model lacks: {unknown[:3]}")
    for name, tensor in tensors.items():
        target = state[name]
        if target.shape != tensor.shape or target.dtype != tensor.dtype:
            raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} in the entry, "
                             f"{tuple(target.shape)} {target.dtype} in the model")
        with torch.no_grad():
            target.copy_(tensor)
    filled = {state[name].data_ptr() for name in tensors}
    missing = sorted(name for name, t in state.items() if t.data_ptr() not in filled)
    if missing:
        raise ValueError(f"the entry lacks tensors: {missing[:3]}")


def _under(name: str, prefixes: set[str]) -> bool:
    return any(name.startswith(prefix + ".") for prefix in prefixes)


@functools.cache
def _module_internals() -> frozenset[str]:
    """nn.Module's own bookkeeping attributes (the rest of a module's __dict__ is its own)."""
    return frozenset(vars(nn.Module())) - {"training"}


def _allowed_class(qualified: str, dataclass_ok: bool = False) -> type:
    """A class of `backends.quantized` (or torch's ModuleList) that the manifest names."""
    module_name, _, name = qualified.rpartition(".")
    if not (qualified.startswith(_ALLOWED_CLASS_PREFIX) or qualified == _MODULE_LIST):
        raise ValueError(f"class {qualified} is not one the cache rebuilds")
    cls = getattr(importlib.import_module(module_name), name)
    kind_ok = dataclasses.is_dataclass(cls) if dataclass_ok else issubclass(cls, nn.Module)
    if not (isinstance(cls, type) and kind_ok):
        raise ValueError(f"{qualified} is not a {'dataclass' if dataclass_ok else 'module'}")
    return cls


def _encode(key: str, value: Any) -> Any:
    """A module attribute as JSON: plain values, dtypes, devices, small tensors, and
    dataclasses of `backends.quantized` (e.g. the int4 packing layout) made of those."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, int | float | str) for v in value):
        return list(value)
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.Tensor) and value.numel() <= _MAX_INLINE_TENSOR:
        return {"tensor": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        if qualified.startswith(_ALLOWED_CLASS_PREFIX):
            fields = {f.name: _encode(f"{key}.{f.name}", getattr(value, f.name))
                      for f in dataclasses.fields(value)}
            return {"dataclass": qualified, "fields": fields}
    raise NotCacheable(f"attribute {key} of type {type(value).__name__}")


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    if "device" in value:
        return torch.device(value["device"])
    cls = _allowed_class(value["dataclass"], dataclass_ok=True)
    return cls(**{name: _decode(v) for name, v in value["fields"].items()})


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def _code_fingerprint() -> str:
    """The code that builds the cached modules: any change to it invalidates the entries."""
    digest = hashlib.sha256()
    for folder in _CODE_DIRS:
        for path in sorted((_ROOT / folder).glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    for name in ("gguf_reader.py", "gguf_experts.py", "weight_cache.py"):
        digest.update((_ROOT / "backends/native/loading" / name).read_bytes())
    return digest.hexdigest()
