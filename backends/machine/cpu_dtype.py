"""Which dtype the engine computes in: bf16 only where this CPU multiplies bf16 natively.

Without AVX512-BF16 or AMX-BF16 (or when torch / oneDNN are capped below them by
ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA), torch multiplies bf16 matrices 30-340x slower
than fp32, so `--dtype auto` picks float32 there. fp16 is slow on every CPU.

`decide_cpu_dtype` is pure (facts in, choice out); `gather_cpu_facts` and
`probe_bf16_matmul` read this machine; `choose_dtype` is what the engine calls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = "/proc/cpuinfo"
# Environment variables that cap torch's or oneDNN's instruction set (read by torch at load).
CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")

# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA): which ones allow native bf16 dot products.
_ONEDNN_BELOW_BF16 = frozenset({
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
})
_ONEDNN_BF16 = frozenset({
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
    "AVX10_2_512_AMX_2", "ALL", "DEFAULT",
})
# torch.backends.cpu.get_cpu_capability() values on x86.
_CAPABILITY_BELOW_AVX512 = frozenset({"DEFAULT", "AVX2", "NO AVX"})
_CAPABILITY_AVX512 = frozenset({"AVX512"})


@dataclass(frozen=True)
class CpuFacts:
    """What decides the CPU dtype. `None` where the fact could not be read."""

    model_name: str | None
    flags: frozenset[str] | None  # /proc/cpuinfo `flags`
    capability: str  # torch.backends.cpu.get_cpu_capability()
    onednn_bf16: bool | None  # oneDNN's own "bf16 supported" (it honours ONEDNN_MAX_CPU_ISA)
    env: Mapping[str, str]  # the CAP_VARIABLES that are set


@dataclass(frozen=True)
class ProbeTiming:
    """Best-of-N seconds of the same small matmul in bf16 and in fp32."""

    bf16_s: float
    fp32_s: float


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def bf16_verdict(facts: CpuFacts) -> tuple[bool | None, str]:
    """(native?, why) from the facts alone; native is None when they do not settle it."""
    if facts.flags is not None and not facts.flags & set(NATIVE_BF16_FLAGS):
        return False, "the CPU has no avx512_bf16 / amx_bf16: bf16 matmul is emulated (slow)"
    capped = _cap(facts)
    if capped:
        return False, capped
    doubts = _doubts(facts)
    if doubts:
        return None, "; ".join(doubts)
    flags = "/".join(f for f in NATIVE_BF16_FLAGS if f in (facts.flags or ()))
    return True, f"native bf16 matmul ({flags}, torch {facts.capability}, oneDNN bf16)"


def _onednn_isa(facts: CpuFacts) -> tuple[str, str] | None:
    """(variable, ISA) of the oneDNN cap in force; ONEDNN_ wins over the older DNNL_."""
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if variable in facts.env:
            return variable, facts.env[variable].strip().upper()
    return None


def _cap(facts: CpuFacts) -> str | None:
    """Why torch or oneDNN is held below native bf16 (None when nothing holds it)."""
    isa = _onednn_isa(facts)
    if isa and isa[1] in _ONEDNN_BELOW_BF16:
        return f"{isa[0]}={isa[1]} caps oneDNN below AVX512_CORE_BF16"
    aten = facts.env.get("ATEN_CPU_CAPABILITY", "").strip().upper()
    if aten in _CAPABILITY_BELOW_AVX512:
        return f"ATEN_CPU_CAPABILITY={aten.lower()} caps torch below AVX-512"
    if facts.capability in _CAPABILITY_BELOW_AVX512:
        return f"torch's CPU capability is {facts.capability}, below AVX-512"
    if facts.onednn_bf16 is False:
        return "oneDNN reports no bf16 support on this CPU"
    return None


def _doubts(facts: CpuFacts) -> list[str]:
    """What we could not read or do not recognize: a probe must settle it."""
    doubts = []
    if facts.flags is None:
        doubts.append("no CPU flags in /proc/cpuinfo")
    isa = _onednn_isa(facts)
    if isa and isa[1] not in _ONEDNN_BF16:
        doubts.append(f"{isa[0]}={isa[1]} is not a oneDNN ISA we know")
    if facts.capability not in _CAPABILITY_AVX512:
        doubts.append(f"unknown torch CPU capability {facts.capability!r}")
    if facts.onednn_bf16 is None:
        doubts.append("oneDNN unavailable")
    return doubts


def decide_cpu_dtype(facts: CpuFacts, probe: Callable[[], ProbeTiming]) -> DtypeChoice:
    """`--dtype auto` on a CPU: bf16 where bf16 matmul is native, float32 otherwise.

    `probe` is called only when the facts are ambiguous; bf16 wins it only if its
    matmul is no slower than fp32's.
    """
    native, why = bf16_verdict(facts)
    if native is None:
        timing = probe()
        native = timing.bf16_s <= timing.fp32_s
        why = (f"{why}; probe: bf16 matmul {timing.bf16_s * 1e3:.2f} ms vs float32 "
               f"{timing.fp32_s * 1e3:.2f} ms")
    return DtypeChoice(torch.bfloat16 if native else torch.float32, f"auto: {why}")


def slow_dtype_warning(dtype: torch.dtype, auto: DtypeChoice) -> str | None:
    """Why an explicit CPU dtype is slow here (None when it is not)."""
    if dtype == torch.float16:
        return "float16 matmul is unusably slow on CPUs (~1 GFLOP/s); use --dtype auto"
    if dtype == torch.bfloat16 and auto.dtype != torch.bfloat16:
        return (f"bfloat16 is slow on this CPU ({auto.reason.removeprefix('auto: ')}); "
                f"--dtype auto would use {auto.name}")
    return None


def read_cpuinfo(path: str = CPUINFO) -> tuple[str | None, frozenset[str] | None]:
    """(model name, flags) of the first processor in /proc/cpuinfo; None where absent."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None, None
    model: str | None = None
    flags: frozenset[str] | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = frozenset(value.split())
        if model is not None and flags is not None:
            break
    return model, flags


def _onednn_bf16() -> bool | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def gather_cpu_facts(cpuinfo: str = CPUINFO) -> CpuFacts:
    model, flags = read_cpuinfo(cpuinfo)
    env = {name: os.environ[name] for name in CAP_VARIABLES if name in os.environ}
    return CpuFacts(model, flags, torch.backends.cpu.get_cpu_capability(), _onednn_bf16(), env)


def probe_bf16_matmul(rows: int = 64, size: int = 512, repeats: int = 5) -> ProbeTiming:
    """Time one (rows x size) @ (size x size) matmul in bf16 and fp32 (~0.1 s when slow)."""
    generator = torch.Generator().manual_seed(0)  # leave the global RNG alone
    best: dict[torch.dtype, float] = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(rows, size, generator=generator).to(dtype)
            b = torch.randn(size, size, generator=generator).to(dtype)
            torch.mm(a, b)  # warm-up: oneDNN builds its kernel on first use
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                torch.mm(a, b)
                times.append(time.perf_counter() - start)
            best[dtype] = min(times)
    return ProbeTiming(best[torch.bfloat16], best[torch.float32])


@functools.cache
def machine_cpu_choice() -> DtypeChoice:
    """`--dtype auto` on this machine's CPU (decided once per process)."""
    return decide_cpu_dtype(gather_cpu_facts(), probe_bf16_matmul)


def machine_key() -> str:
    """Names this CPU kind for caches of compiled code: torch's capability plus a hash of the
    CPU flags and the capability caps in the environment."""
    facts = gather_cpu_facts()
    described = repr((sorted(facts.flags or ()), sorted(facts.env.items())))
    return f"{facts.capability.lower()}-{hashlib.sha256(described.encode()).hexdigest()[:12]}"


def choose_dtype(requested: torch.dtype | None, device: torch.device) -> DtypeChoice:
    """The engine's dtype: `requested` (None means auto) on `device`, logged with its reason."""
    if device.type != "cpu":
        reason = "explicit --dtype" if requested else f"auto on {device.type}: float16"
        choice = DtypeChoice(requested or torch.float16, reason)
    elif requested is None:
        choice = machine_cpu_choice()
    else:
        choice = _explicit_cpu(requested)
    log.info("dtype %s: %s", choice.name, choice.reason)
    return choice


def _explicit_cpu(dtype: torch.dtype) -> DtypeChoice:
    if dtype == torch.float32:
        return DtypeChoice(dtype, "explicit --dtype")
    auto = machine_cpu_choice()
    warning = slow_dtype_warning(dtype, auto)
    if warning:
        log.warning("--dtype %s: %s", str(dtype).removeprefix("torch."), warning)
        return DtypeChoice(dtype, f"explicit --dtype; {warning}")
    return DtypeChoice(dtype, f"explicit --dtype ({auto.reason.removeprefix('auto: ')})")
