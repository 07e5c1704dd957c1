"""Our C++ CPU kernels, built for this CPU with the system's C++ compiler (the one
torch.compile already needs) into one shared library and loaded as torch operators, once per
process:

    switchyard_cpu::q4_mm             int8_dot.cpp: 4-bit weights x int8 inputs
    switchyard_cpu::q8_mm             q8_dot.cpp: 8-bit weights (GGUF Q8_0) x int16 inputs
    switchyard_cpu::q4_dequantize_kn  int4_dequant.cpp: the same weights as a dense [K, N]
    switchyard_cpu::paged_decode_attention  paged_attention.cpp: decode rows over KV blocks
    switchyard_cpu::paged_prefill_attention  prefill_attention.cpp: a prompt chunk, causal
    switchyard_cpu::prepacked_linear  prepacked_linear.cpp: cpu_linear.py's oneDNN call
    switchyard_cpu::bf16_linear       bf16_linear.cpp: dense bf16 linears (AVX-512-BF16 only)
    switchyard_cpu::bf16_silu_mul_linear  the same, an MLP's gate / up with silu(gate) * up
    switchyard_cpu::f32_linear        f32_linear.cpp: dense float32 linears (AVX2 only)
    switchyard_cpu::f32_silu_mul_linear  the same, an MLP's gate / up with silu(gate) * up
    switchyard_cpu::row_argmax        row_argmax.cpp: greedy sampling's argmax per row
    switchyard_cpu::q4_decode_layers  decode_layers.cpp: a decode step's 4-bit layers, chained
    switchyard_cpu::bf16_decode_layers  bf16_decode_layers.cpp: the same for bf16 kernel linears
    switchyard_cpu::greedy_head_argmax  greedy_head.cpp: greedy tokens without every logit

The library is cached under the cache directory (`SWITCHYARD_CACHE_DIR`, default
`~/.cache/switchyard`) in `kernels/`, named by everything that goes into it; a build takes
~26 s on 2 cores (sources compile in parallel; the attention kernels are instantiated per head
size and dtype), a cached load milliseconds.

Which code: AVX-512 (with VNNI) where the CPU has it and torch dispatches to AVX-512, AVX2 (+
FMA, F16C) where torch dispatches to AVX2 or better, else none (the engine keeps torch's
kernels). `SWITCHYARD_CPU_KERNELS` = `auto` (default) / `avx512-vnni` / `avx2` / `off`
overrides the choice (tests and A/B benchmarks).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from backends.machine.cache_dir import DEFAULT_CACHE_DIR, cache_root
from backends.machine.cpu_dtype import read_cpuinfo

log = logging.getLogger(__name__)

# Each source with its own extra flags (e.g. -ffast-math where exp loops should vectorise).
SOURCES: dict[Path, tuple[str, ...]] = {
    Path(__file__).with_name("int8_dot.cpp"): (),
    Path(__file__).with_name("q8_dot.cpp"): (),
    Path(__file__).with_name("int4_dequant.cpp"): (),
    Path(__file__).with_name("paged_attention.cpp"): (),
    Path(__file__).with_name("prefill_attention.cpp"): (),
    Path(__file__).with_name("prepacked_linear.cpp"): (),
    Path(__file__).with_name("bf16_linear.cpp"): (),
    Path(__file__).with_name("f32_linear.cpp"): (),
    Path(__file__).with_name("row_argmax.cpp"): (),
    Path(__file__).with_name("decode_layers.cpp"): (),
    Path(__file__).with_name("greedy_head.cpp"): (),
    Path(__file__).with_name("bf16_decode_layers.cpp"): (),
}
# Sources with code for an extension only some CPUs of a variant have: its flag is added where
# the CPU has it (else the source builds its operators as refusing stubs).
OPTIONAL_ISA = {Path(__file__).with_name(name): ("avx512-vnni", "avx512_bf16", "-mavx512bf16")
                for name in ("bf16_linear.cpp", "prefill_attention.cpp", "greedy_head.cpp",
                             "bf16_decode_layers.cpp")}
HEADERS = (Path(__file__).with_name("simd.h"),
           Path(__file__).with_name("kernel_entry_points.h"),
           Path(__file__).with_name("work_shares.h"))
SETTING = "SWITCHYARD_CPU_KERNELS"
VARIANTS = {
    "avx512-vnni": ("-DSWITCHYARD_VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512vnni", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
_NEEDS_FLAGS = {"avx512-vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"},
                "avx2": {"avx2", "fma", "f16c"}}
_NEEDS_TORCH_ISA = {"avx512-vnni": ("AVX512",), "avx2": ("AVX2", "AVX512")}
BUILD_TIMEOUT_S = 600


def suitable_variant(flags: frozenset[str] | None, capability: str, setting: str) -> str | None:
    """The code this CPU (flags) and torch's dispatch (capability) should run, or None."""
    setting = setting.strip().lower() or "auto"
    if setting == "off":
        return None
    candidates = tuple(VARIANTS) if setting == "auto" else (setting,)
    if setting not in ("auto", *VARIANTS):
        raise ValueError(f"{SETTING}={setting!r}: choose auto, off or one of {sorted(VARIANTS)}")
    for name in candidates:
        fits_cpu = flags is not None and _NEEDS_FLAGS[name] <= flags
        if fits_cpu and capability in _NEEDS_TORCH_ISA[name]:
            return name
    return None


@functools.cache
def active_variant() -> str | None:
    """Builds (or finds) and loads the kernels for this process; their variant, or None where
    this CPU, the setting or the build rules them out (a failed build is logged, not raised)."""
    _, flags = read_cpuinfo()
    name = suitable_variant(flags, torch.backends.cpu.get_cpu_capability(),
                            os.environ.get(SETTING, "auto"))
    if name is None:
        return None
    try:
        torch.ops.load_library(str(built_library(KernelBuild(name))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("our CPU kernels are unavailable (%s); torch's kernels run instead", exc)
        return None
    _register_fake()
    return name


@functools.cache
def bf16_linear_built() -> bool:
    """Whether our kernels are loaded with the AVX-512-BF16 linear (bf16_linear.cpp)."""
    return active_variant() is not None and bool(torch.ops.switchyard_cpu.bf16_linear_built())


@dataclass(frozen=True)
class KernelBuild:
    """What goes into one library: the variant's flags, which sources, and for tests extra
    flags (before each source), the headers those bring in and the library's name."""

    variant: str
    sources: tuple[Path, ...] = tuple(SOURCES)
    extra_flags: tuple[str, ...] = ()
    extra_headers: tuple[Path, ...] = ()
    prefix: str = "switchyard_cpu"


def built_library(spec: KernelBuild) -> Path:
    """The library `spec` describes, from the cache or built there (sources in parallel,
    renamed into place: atomic); named by everything that goes into it."""
    folder = _kernel_dir()
    objects = Path("obj")
    commands = [*_compile_commands(spec, objects), _link_command(spec, objects, Path("out"))]
    key = hashlib.sha256("\n".join([
        *[source.read_text() for source in (*spec.sources, *HEADERS, *spec.extra_headers)],
        torch.__version__, *[" ".join(command) for command in commands],
    ]).encode()).hexdigest()[:16]
    target = folder / f"{spec.prefix}-{spec.variant}-{key}.so"
    if target.exists():
        return target
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / target.name
        compiles = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True) for command in _compile_commands(spec, Path(tmp))]
        for process in compiles:
            _, errors = process.communicate(timeout=BUILD_TIMEOUT_S)
            if process.returncode != 0:
                raise RuntimeError(f"building our CPU kernels failed: {errors.strip()[-2000:]}")
        linked = subprocess.run(_link_command(spec, Path(tmp), built), capture_output=True,
                                text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if linked.returncode != 0:
            raise RuntimeError(f"linking our CPU kernels failed: {linked.stderr.strip()[-2000:]}")
        os.replace(built, target)
    log.info("CPU kernels (%s) built in %.1fs: %s", spec.variant, time.perf_counter() - start,
             target)
    return target


def _compile_commands(spec: KernelBuild, folder: Path) -> list[list[str]]:
    """One command per source (object file in `folder`), in parallel."""
    compiler = os.environ.get("CXX", "g++")
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    _, flags = read_cpuinfo()
    return [[compiler, "-O3", "-fPIC", "-std=c++20", "-fopenmp", *VARIANTS[spec.variant],
             *SOURCES.get(source, ()), *spec.extra_flags,
             *_optional_isa_flags(source, spec.variant, flags or frozenset()),
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", *includes, "-c", str(source),
             "-o", str(folder / f"{source.stem}.o")]
            for source in spec.sources]


def _optional_isa_flags(source: Path, name: str, flags: frozenset[str]) -> tuple[str, ...]:
    variant, cpu_flag, compiler_flag = OPTIONAL_ISA.get(source, ("", "", ""))
    return (compiler_flag,) if variant == name and cpu_flag in flags else ()


def _link_command(spec: KernelBuild, folder: Path, output: Path) -> list[str]:
    lib_dirs = cpp_extension.library_paths()
    return [os.environ.get("CXX", "g++"), "-shared", "-fopenmp",
            *[str(folder / f"{source.stem}.o") for source in spec.sources], "-o", str(output),
            *[f"-L{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu",
            *[f"-Wl,-rpath,{d}" for d in lib_dirs]]


def _kernel_dir() -> Path:
    root = cache_root(os.environ.get("SWITCHYARD_CACHE_DIR", DEFAULT_CACHE_DIR))
    root = root or Path(DEFAULT_CACHE_DIR).expanduser()  # kernels are cached even then
    for folder in (root / "kernels", Path(tempfile.gettempdir()) / "switchyard-kernels"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        except OSError:
            continue
    raise OSError("no writable folder for our CPU kernels")


def _register_fake() -> None:
    @torch.library.register_fake("switchyard_cpu::q4_mm")
    def _q4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor,
               group_size: int, fine: bool) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("switchyard_cpu::q8_mm")
    def _q8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("switchyard_cpu::q4_dequantize_kn")
    def _q4_dequantize_kn(packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
                          dtype: torch.dtype) -> torch.Tensor:
        return packed.new_empty(packed.shape[1] * 8, packed.shape[0] * 16, dtype=dtype)

    @torch.library.register_fake("switchyard_cpu::paged_decode_attention")
    def _paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, mask: torch.Tensor,
                                scale: float) -> torch.Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake("switchyard_cpu::paged_prefill_attention")
    def _paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_table: torch.Tensor, context: int, window: int,
                                 scale: float) -> torch.Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake("switchyard_cpu::bf16_linear")
    def _bf16_linear(x: torch.Tensor, packed: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], packed.shape[0] * 16))

    @torch.library.register_fake("switchyard_cpu::bf16_silu_mul_linear")
    def _bf16_silu_mul_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], packed.shape[0] * 8))

    @torch.library.register_fake("switchyard_cpu::f32_linear")
    def _f32_linear(x: torch.Tensor, packed: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], packed.shape[0] * 16))

    @torch.library.register_fake("switchyard_cpu::f32_silu_mul_linear")
    def _f32_silu_mul_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], packed.shape[0] * 8))

    @torch.library.register_fake("switchyard_cpu::prepacked_linear")
    def _prepacked_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int,
                          bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], out_features))
