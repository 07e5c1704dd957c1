"""The quantization in use, parsed once: from the checkpoint's `quantization_config`, the
`--quantize` flag (formats that quantize at load), or a GGUF file's tensor types.

Every check that can fail on a checkpoint's declaration fails here, naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

QUANTIZE_CHOICES = (
    "gptq", "awq", "eetq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "gguf", "none",
)
AT_LOAD = ("eetq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
# --quantized-kernels: auto (gptqmodel's CUDA kernels for GPTQ / AWQ where installed and one
# fits, else native), native (backends/quantized's torch kernels), gptqmodel (forced)
KERNEL_CHOICES = ("auto", "native", "gptqmodel")


class QuantizationError(ValueError):
    """A quantized checkpoint (or --quantize) that cannot be loaded; the message names why."""


def check_kernels_setting(value: str) -> str:
    if value not in KERNEL_CHOICES:
        raise QuantizationError(
            f"--quantized-kernels {value!r} is not one of {', '.join(KERNEL_CHOICES)}"
        )
    return value


@dataclass(frozen=True)
class GPTQConfig:
    bits: int
    group_size: int  # -1: one group over all input features
    sym: bool
    desc_act: bool
    lm_head: bool = False  # the lm_head is quantized too (gptqmodel's `lm_head=True`)
    # gptqmodel's `dynamic`: (pattern, overrides) in order, the first re.match wins;
    # overrides None: the module is not quantized ("-:pattern")
    dynamic: tuple[tuple[str, tuple[tuple[str, Any], ...] | None], ...] = ()
    method: Literal["gptq"] = "gptq"

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        kind = "sym" if self.sym else "asym"
        order = ", desc_act" if self.desc_act else ""
        head = ", lm_head" if self.lm_head else ""
        rules = f", per-module rules: {len(self.dynamic)}" if self.dynamic else ""
        return f"gptq {self.bits}-bit {group} {kind}{order}{head}{rules}"

    def for_module(self, name: str) -> GPTQConfig | None:
        """The layout of checkpoint module `name` (None: it is not quantized)."""
        for pattern, overrides in self.dynamic:
            if re.match(pattern, name):
                return None if overrides is None else replace(self, dynamic=(), **dict(overrides))
        return replace(self, dynamic=()) if self.dynamic else self


@dataclass(frozen=True)
class AWQConfig:
    bits: int
    group_size: int
    zero_point: bool
    method: Literal["awq"] = "awq"

    def describe(self) -> str:
        return f"awq {self.bits}-bit gemm group {self.group_size}" + (
            "" if self.zero_point else " no-zero-point"
        )


@dataclass(frozen=True)
class EETQConfig:
    method: Literal["eetq"] = "eetq"

    def describe(self) -> str:
        return "eetq int8 per-channel (quantized at load)"


@dataclass(frozen=True)
class BnbConfig:
    kind: Literal["int8", "nf4", "fp4"]
    prequantized: bool  # the checkpoint holds bnb tensors (else: quantize at load)
    double_quant: bool = False
    blocksize: int = 64
    threshold: float = 6.0  # LLM.int8 outlier threshold
    method: Literal["bitsandbytes"] = "bitsandbytes"

    def describe(self) -> str:
        where = "pre-quantized" if self.prequantized else "quantized at load"
        return f"bitsandbytes {self.kind} ({where})"


@dataclass(frozen=True)
class GGUFConfig:
    method: Literal["gguf"] = "gguf"

    def describe(self) -> str:
        return "gguf (kept quantized)"


QuantConfig = GPTQConfig | AWQConfig | EETQConfig | BnbConfig | GGUFConfig


def resolve_quantization(
    hf_config: Any, checkpoint_format: str, quantize: str | None
) -> QuantConfig | None:
    """The quantization to load with, or None for dense weights."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise QuantizationError(
            f"--quantize {quantize!r} is not one of {', '.join(QUANTIZE_CHOICES)}"
        )
    declared = getattr(hf_config, "quantization_config", None)
    if checkpoint_format == "gguf":
        return _gguf(quantize)
    if declared:
        return _from_checkpoint(_as_dict(declared), quantize)
    if quantize in (None, "none"):
        return None
    if quantize in ("gptq", "awq", "gguf"):
        raise QuantizationError(
            f"--quantize {quantize}: the checkpoint has no quantization_config "
            f"(a {quantize} checkpoint declares one in config.json)"
        )
    if quantize == "eetq":
        return EETQConfig()
    return BnbConfig(kind=_BNB_FLAGS[quantize], prequantized=False)


_BNB_FLAGS: dict[str, Literal["int8", "nf4", "fp4"]] = {
    "bitsandbytes": "int8", "bitsandbytes-nf4": "nf4", "bitsandbytes-fp4": "fp4",
}


def _gguf(quantize: str | None) -> GGUFConfig | None:
    if quantize in (None, "gguf"):
        return GGUFConfig()
    if quantize == "none":
        return None
    raise QuantizationError(f"--quantize {quantize} does not apply to a .gguf file")


def _as_dict(declared: Any) -> dict[str, Any]:
    if isinstance(declared, dict):
        return declared
    if hasattr(declared, "to_dict"):
        return declared.to_dict()
    raise QuantizationError(f"quantization_config is not a mapping: {declared!r}")


def _from_checkpoint(qc: dict[str, Any], quantize: str | None) -> QuantConfig | None:
    method = qc.get("quant_method")
    if quantize == "none":
        raise QuantizationError(
            f"--quantize none: the checkpoint is quantized ({method}); "
            "serve it as it is or convert it to a dense checkpoint"
        )
    parsers = {"gptq": _gptq, "awq": _awq, "bitsandbytes": _bnb}
    if method not in parsers:
        raise QuantizationError(
            f"quantization_config.quant_method {method!r} is not supported "
            f"(supported: {', '.join(parsers)})"
        )
    if quantize is not None and not (quantize == method or quantize.startswith(str(method))):
        raise QuantizationError(
            f"--quantize {quantize} does not match the checkpoint's quant_method {method!r}"
        )
    return parsers[method](qc)


def _int_field(qc: dict[str, Any], name: str, allowed: tuple[int, ...], method: str) -> int:
    value = qc.get(name)
    if not isinstance(value, int) or value not in allowed:
        raise QuantizationError(
            f"quantization_config.{name}={value!r} is not supported for {method} "
            f"(supported: {', '.join(map(str, allowed))})"
        )
    return value


def _gptq(qc: dict[str, Any]) -> GPTQConfig:
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", None):
        raise QuantizationError(
            f"quantization_config.checkpoint_format={fmt!r} is not supported "
            "(only GPTQ v1 checkpoints, checkpoint_format 'gptq')"
        )
    return GPTQConfig(
        bits=_int_field(qc, "bits", _GPTQ_BITS, "gptq"),
        group_size=_int_field(qc, "group_size", _GPTQ_GROUPS, "gptq"),
        sym=bool(qc.get("sym", True)),
        desc_act=bool(qc.get("desc_act", False)),
        lm_head=bool(qc.get("lm_head", False)),
        dynamic=_dynamic(qc.get("dynamic") or {}),
    )


_GPTQ_BITS, _GPTQ_GROUPS = (4, 8), (-1, 32, 64, 128, 256)


def _dynamic(rules: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...] | None], ...]:
    """gptqmodel's per-module overrides: {"[+:|-:]regex": {"bits": 8, ...}}, in order."""
    if not isinstance(rules, dict):
        raise QuantizationError(f"quantization_config.dynamic is not a mapping: {rules!r}")
    parsed = []
    for key, overrides in rules.items():
        pattern = key[2:] if key.startswith(("+:", "-:")) else key
        try:
            re.compile(pattern)
        except re.error as exc:
            raise QuantizationError(
                f"quantization_config.dynamic: bad pattern {key!r} ({exc})") from None
        if key.startswith("-:"):
            parsed.append((pattern, None))
            continue
        if not isinstance(overrides, dict):
            raise QuantizationError(f"quantization_config.dynamic[{key!r}] is not a mapping")
        parsed.append((pattern, _dynamic_overrides(key, overrides)))
    return tuple(parsed)


def _dynamic_overrides(key: str, overrides: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The layout fields of one rule (others, such as gptqmodel's `mse`, only shaped the
    quantization and do not change how the tensors are read)."""
    where = f"dynamic[{key!r}]"
    fields: dict[str, Any] = {}
    if "bits" in overrides:
        fields["bits"] = _int_field(overrides, "bits", _GPTQ_BITS, f"gptq {where}")
    if "group_size" in overrides:
        fields["group_size"] = _int_field(overrides, "group_size", _GPTQ_GROUPS, f"gptq {where}")
    for flag in ("sym", "desc_act"):
        if flag in overrides:
            fields[flag] = bool(overrides[flag])
    return tuple(sorted(fields.items()))


def _awq(qc: dict[str, Any]) -> AWQConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(
            f"quantization_config.version={version!r} is not supported (only AWQ 'gemm')"
        )
    bits = _int_field(qc, "bits" if "bits" in qc else "w_bit", (4,), "awq")
    group_key = "group_size" if "group_size" in qc else "q_group_size"
    return AWQConfig(
        bits=bits,
        group_size=_int_field(qc, group_key, (32, 64, 128), "awq"),
        zero_point=bool(qc.get("zero_point", True)),
    )


def _bnb(qc: dict[str, Any]) -> BnbConfig:
    if qc.get("load_in_8bit"):
        return BnbConfig(
            kind="int8", prequantized=True,
            threshold=float(qc.get("llm_int8_threshold", 6.0)),
        )
    if not qc.get("load_in_4bit"):
        raise QuantizationError(
            "quantization_config (bitsandbytes) sets neither load_in_4bit nor load_in_8bit"
        )
    kind = qc.get("bnb_4bit_quant_type", "fp4")
    if kind not in ("nf4", "fp4"):
        raise QuantizationError(
            f"quantization_config.bnb_4bit_quant_type={kind!r} is not supported (nf4, fp4)"
        )
    return BnbConfig(
        kind=kind, prequantized=True,
        double_quant=bool(qc.get("bnb_4bit_use_double_quant", False)),
    )
