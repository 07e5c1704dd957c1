"""TransformersOptions: the transformers backend's knobs, validated strictly at creation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class TransformersOptions:
    dtype: str = "auto"  # auto: backends/machine/cpu_dtype.py decides on CPU; float16 on CUDA
    device: str = "cpu"  # cpu | cuda | cuda:N
    max_input_tokens: int | None = None  # default: max_total_tokens - 1
    max_total_tokens: int | None = None  # default: min(model context, 4096)
    max_concurrent_requests: int = 128  # in flight (running + queued); beyond it, 429
    num_threads: int | None = None  # torch intra-op threads; None: torch's default

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.device, str) or not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device {self.device!r} is not cpu, cuda or cuda:N")
        for name in ("max_input_tokens", "max_total_tokens", "num_threads"):
            _check_positive(name, getattr(self, name), optional=True)
        _check_positive("max_concurrent_requests", self.max_concurrent_requests, optional=False)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> TransformersOptions:
        """Options from a BackendSpec; an unknown name is a ValueError that names it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown transformers backend option(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**options)


def _check_positive(name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")


def shared_engine_flags(engine_flags: Mapping[str, Any]) -> dict[str, Any]:
    """The gateway-wide engine flags this backend also takes (dtype, device, limits...);
    the others (KV cache, batching, compile) mean nothing to `generate` and are left out."""
    known = {f.name for f in dataclasses.fields(TransformersOptions)}
    return {name: value for name, value in engine_flags.items() if name in known}
