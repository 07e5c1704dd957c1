"""Our C++ CPU kernels, built for this CPU with the system's C++ compiler (the one
torch.compile already needs) into one shared library and loaded as torch operators, once per
process:

    switchyard_cpu::q4_mm             int8_dot.cpp: 4-bit weights x int8 inputs
    switchyard_cpu::q8_mm             q8_dot.cpp: 8-bit weights (GGUF Q8_0) x int16 inputs
    switchyard_cpu::q8_dequantize     the same weights as a dense [N, K]
    switchyard_cpu::kquant_mm         kquant_dot.cpp: GGUF Q5_0 / Q5_1 / Q5_K / Q6_K as stored
    switchyard_cpu::kquant_dequantize  the same blocks as a dense [N, K]
    switchyard_cpu::kquant_pack / kquant_packed_mm / kquant_packed_dequantize: the same types
                                      repacked once at load for the SIMD lanes (KQuantLinear)
    switchyard_cpu::q4_dequantize_kn  int4_dequant.cpp: the same weights as a dense [K, N]
    switchyard_cpu::q4_dense_mm / kquant_dense_mm / q8_dense_mm  prefill's products, the
                                      weight dequantized a slice at a time (dense_slices.h)
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
    switchyard_cpu::bf16_moe_block    moe_block.cpp: an MoE block whose experts run the bf16 kernel
    switchyard_cpu::greedy_head_argmax  greedy_head.cpp: greedy tokens without every logit

The library is cached under the cache directory (`SWITCHYARD_CACHE_DIR`, default
`~/.cache/switchyard`) in `kernels/`, named by everything that goes into it; a build takes
~26 s on 2 cores (sources compile in parallel; the attention kernels are instantiated per head
size and dtype), a cached load milliseconds.

Which code: AVX-512 (with VNNI) where the CPU has it and torch dispatches to AVX-512, AVX2 (+
FMA, F16C) where torch dispatches to AVX2 or better, else none (the engine keeps torch's
kernels). `SWITCHYARD_CPU_KERNELS` = `auto` (default) / `required` / `avx512-vnni` / `avx2` /
`off` overrides the choice; `kernel_status()` says which code runs, or why none (status.py).
"""

from __future__ import annotations

import fcntl
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

from backends.cpu_kernels.status import (
    SETTING,
    KernelStatus,
    compiler_message,
    loaded,
    normalize,
    read_setting,
    unavailable,
)
from backends.machine.cache_dir import DEFAULT_CACHE_DIR, cache_root
from backends.machine.cpu_dtype import read_cpuinfo

log = logging.getLogger(__name__)

# Each source with its own extra flags (e.g. -ffast-math where exp loops should vectorise).
SOURCES: dict[Path, tuple[str, ...]] = {
    Path(__file__).with_name("int8_dot.cpp"): (),
    Path(__file__).with_name("q8_dot.cpp"): (),
    Path(__file__).with_name("kquant_dot.cpp"): (),
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
    Path(__file__).with_name("moe_block.cpp"): (),
}
# Sources with code for an extension only some CPUs of a variant have: its flag is added where
# the CPU has it (else the source builds its operators as refusing stubs).
OPTIONAL_ISA = {Path(__file__).with_name(name): ("avx512-vnni", "avx512_bf16", "-mavx512bf16")
                for name in ("bf16_linear.cpp", "prefill_attention.cpp", "greedy_head.cpp",
                             "bf16_decode_layers.cpp", "moe_block.cpp")}
HEADERS = (Path(__file__).with_name("simd.h"),
           Path(__file__).with_name("kernel_entry_points.h"),
           Path(__file__).with_name("work_shares.h"),
           Path(__file__).with_name("dense_slices.h"))
VARIANTS = {
    "avx512-vnni": ("-DSWITCHYARD_VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512vnni", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
_NEEDS_FLAGS = {"avx512-vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"},
                "avx2": {"avx2", "fma", "f16c"}}
_NEEDS_TORCH_ISA = {"avx512-vnni": ("AVX512",), "avx2": ("AVX2", "AVX512")}
BUILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class Choice:
    """The build variant to load, or why none (for `none (<why>)`)."""

    variant: str | None
    reason: str = ""


def choose_variant(flags: frozenset[str] | None, capability: str, setting: str) -> Choice:
    """The code this CPU (flags), torch's dispatch (capability) and the setting allow."""
    setting = normalize(setting)
    if setting == "off":
        return Choice(None, f"off by {SETTING}=off")
    if flags is None:
        return Choice(None, "this CPU's instruction sets could not be read (/proc/cpuinfo)")
    reason = ""
    for name in (setting,) if setting in VARIANTS else tuple(VARIANTS):
        missing = _NEEDS_FLAGS[name] - flags
        if missing:
            reason = f"this CPU lacks {name} (no {', '.join(sorted(missing))})"
        elif capability not in _NEEDS_TORCH_ISA[name]:
            reason = (f"torch dispatches to {capability} code (ATEN_CPU_CAPABILITY), "
                      f"below {name}")
        else:
            return Choice(name)
    return Choice(None, reason)  # the last candidate's: the least any variant needs


def suitable_variant(flags: frozenset[str] | None, capability: str, setting: str) -> str | None:
    """The code this CPU (flags) and torch's dispatch (capability) should run, or None."""
    return choose_variant(flags, capability, setting).variant


@functools.cache
def kernel_status() -> KernelStatus:
    """Builds (or finds) and loads the kernels for this process, once, under the setting of
    that first call (a model's load); which run, or why none. A failed build is logged as an
    error with the compiler's message and torch's kernels run (`required` makes the load fail:
    status.require)."""
    _, flags = read_cpuinfo()
    setting = read_setting()
    choice = choose_variant(flags, torch.backends.cpu.get_cpu_capability(), setting)
    if choice.variant is None:
        log.info("cpu_kernels: none (%s)", choice.reason)
        return unavailable(choice.reason)
    status = _load(choice.variant)
    if status.active:
        log.info("cpu_kernels: %s", status.describe())
    else:
        log.error("cpu_kernels: %s%s", status.describe(),
                  "" if setting == "required" else "; torch's kernels run instead")
    return status


def _load(variant: str) -> KernelStatus:
    try:
        library = built_library(KernelBuild(variant))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return unavailable(f"the CPU kernels could not be built: {exc}")
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        return unavailable(f"the CPU kernels could not be loaded: {exc}")
    _register_fake()
    return loaded(variant, bool(torch.ops.switchyard_cpu.bf16_linear_built()))


def active_variant() -> str | None:
    """The build variant loaded (`avx512-vnni` / `avx2`), or None: see kernel_status."""
    return kernel_status().build


def bf16_linear_built() -> bool:
    """Whether our kernels are loaded with the AVX-512-BF16 linear (bf16_linear.cpp)."""
    return kernel_status().variant == "avx512-bf16"


class BuildFailed(RuntimeError):
    """The compiler or linker failed; the message is the last meaningful lines it printed."""


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
    """The library `spec` describes, from the cache or built there (sources a core each,
    renamed into place: atomic; one build per library at a time on a machine); named by
    everything that goes into it."""
    folder = _kernel_dir()
    target = folder / library_name(spec)
    if target.exists():
        return target
    # One build of a library at a time on a machine: replicas or test processes starting on a
    # cold cache wait for the first one's build instead of each compiling (and each holding
    # a compiler's ~0.5 GB per source).
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _build_into(spec, folder, target)
    return target


def _build_into(spec: KernelBuild, folder: Path, target: Path) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / target.name
        _compile(_compile_commands(spec, Path(tmp)))
        linked = subprocess.run(_link_command(spec, Path(tmp), built), capture_output=True,
                                text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if linked.returncode != 0:
            log.debug("linker stderr:\n%s", linked.stderr)
            raise BuildFailed(f"linking failed: {compiler_message(linked.stderr)}")
        os.replace(built, target)
    log.info("CPU kernels (%s) built in %.1fs: %s", spec.variant, time.perf_counter() - start,
             target)


def library_name(spec: KernelBuild) -> str:
    """The file name of the library `spec` describes: a hash of its sources, headers, torch's
    version and the build commands, without the folders they run from."""
    objects = Path("obj")
    commands = [*_compile_commands(spec, objects), _link_command(spec, objects, Path("out"))]
    key = hashlib.sha256("\n".join([
        *[source.read_text() for source in (*spec.sources, *HEADERS, *spec.extra_headers)],
        torch.__version__, *[_portable(" ".join(command)) for command in commands],
    ]).encode()).hexdigest()[:16]
    return f"{spec.prefix}-{spec.variant}-{key}.so"


def _portable(command: str) -> str:
    """`command` without the folders it was run from: the same sources, flags and torch version
    make the same library wherever they are installed (a reinstall, a fresh clone or another
    venv with the same torch reuses it)."""
    torch_root = str(Path(torch.__file__).parent)
    return command.replace(str(Path(__file__).parent), "<sources>").replace(torch_root, "<torch>")


def _compile(commands: list[list[str]]) -> None:
    """Runs the compiles, as many at once as this process may use cores; BuildFailed with
    the first failure's message (the others are stopped)."""
    width = max(1, len(os.sched_getaffinity(0)))
    running: list[subprocess.Popen[str]] = []
    try:
        for command in commands:
            if len(running) == width:
                _finish(running.pop(0))
            running.append(subprocess.Popen(command, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True))
        while running:
            _finish(running.pop(0))
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()


def _finish(process: subprocess.Popen[str]) -> None:
    _, errors = process.communicate(timeout=BUILD_TIMEOUT_S)
    if process.returncode != 0:
        log.debug("compiler stderr:\n%s", errors)
        raise BuildFailed(compiler_message(errors))


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

    @torch.library.register_fake("switchyard_cpu::q8_dequantize")
    def _q8_dequantize(packed: torch.Tensor, scales: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
        return packed.new_empty(packed.shape[0] * 16, packed.shape[1] * 4, dtype=dtype)

    @torch.library.register_fake("switchyard_cpu::q8_dense_mm")
    def _q8_dense_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("switchyard_cpu::q4_dense_mm")
    def _q4_dense_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor,
                     group_size: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("switchyard_cpu::kquant_dense_mm")
    def _kquant_dense_mm(x: torch.Tensor, packed: torch.Tensor, type: int,
                         in_features: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("switchyard_cpu::kquant_mm")
    def _kquant_mm(x: torch.Tensor, blocks: torch.Tensor, type: int,
                   in_features: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("switchyard_cpu::kquant_packed_mm")
    def _kquant_packed_mm(x: torch.Tensor, packed: torch.Tensor, type: int,
                          in_features: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("switchyard_cpu::kquant_packed_dequantize")
    def _kquant_packed_dequantize(packed: torch.Tensor, type: int, in_features: int,
                                  dtype: torch.dtype) -> torch.Tensor:
        return packed.new_empty(packed.shape[0], in_features, dtype=dtype)

    @torch.library.register_fake("switchyard_cpu::kquant_dequantize")
    def _kquant_dequantize(blocks: torch.Tensor, type: int, in_features: int,
                           dtype: torch.dtype) -> torch.Tensor:
        return blocks.new_empty(blocks.shape[0], in_features, dtype=dtype)

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

    @torch.library.register_fake("switchyard_cpu::bf16_moe_block")
    def _bf16_moe_block(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, top_k: int, renormalize: bool,
                        float32_weights: bool, expert_tokens: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

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
