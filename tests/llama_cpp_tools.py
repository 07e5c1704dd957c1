"""llama.cpp's own `llama-quantize`, for tests that check our loader on files llama.cpp made.

Built with CMake from the llama.cpp vendored in the `llama-cpp-python` sdist (from PyPI, the
version bench/peers.py builds `llama-server` from) into the cache directory
(`SWITCHYARD_CACHE_DIR`, default `~/.cache/switchyard`) under `llama.cpp/<version>/`, once
per machine. A cold build takes ~10 minutes of one core: the test session starts it in the
background, one job at nice 19, as soon as it has collected a test that needs it
(tests/conftest.py), so it runs on the core the single-threaded suite leaves idle; the test
waits for it. One build at a time per cache folder (a lock), so parallel sessions share it.

    python -m tests.llama_cpp_tools          # build now, in the foreground
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from backends.machine.cache_dir import DEFAULT_CACHE_DIR, cache_root

VERSION = "0.3.36"
TARGET = "llama-quantize"
TESTS = "tests/quantized/test_llama_quantize.py"  # the tests that use it


def tools_dir() -> Path:
    root = cache_root(os.environ.get("SWITCHYARD_CACHE_DIR", DEFAULT_CACHE_DIR))
    return (root or Path(DEFAULT_CACHE_DIR).expanduser()) / "llama.cpp" / VERSION


def binary() -> Path:
    return tools_dir() / "build" / "bin" / TARGET


def _log() -> Path:
    return tools_dir() / "build.log"


def _done() -> Path:
    return tools_dir() / "built"


def _failed() -> Path:
    return tools_dir() / "failed"


def start_build() -> None:
    """Starts the build in the background unless it is done (a build under way holds the
    lock: the new one waits for it and finds it done). A failed build is tried again."""
    if _done().exists():
        return
    tools_dir().mkdir(parents=True, exist_ok=True)
    _failed().unlink(missing_ok=True)
    with open(_log(), "ab") as log:
        subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "tests.llama_cpp_tools"],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                         cwd=Path(__file__).resolve().parents[1])


def wait_for_build(timeout_s: float) -> Path:
    """The built binary, once the build is done (started here if no one started it)."""
    start_build()
    deadline = time.monotonic() + timeout_s
    while not _done().exists():
        if _failed().exists():
            tail = _log().read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError(f"building {TARGET} failed:\n" + "\n".join(tail))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{TARGET} not built after {timeout_s:.0f} s; see {_log()}")
        time.sleep(2)
    return binary()


def _sources(folder: Path) -> Path:
    """The vendored llama.cpp of the sdist, downloaded and unpacked under `folder`."""
    unpacked = folder / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if unpacked.exists():
        return unpacked
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    ":all:", f"llama-cpp-python=={VERSION}", "-d", str(folder)], check=True)
    with tarfile.open(folder / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
        tar.extractall(folder, filter="data")
    return unpacked


def build() -> None:
    """Downloads, configures and builds the binary into tools_dir() (one process at a time)."""
    folder = tools_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _done().exists():
            return
        try:
            _configure_and_build(_sources(folder / "src"), folder / "build")
        except BaseException:
            _failed().touch()
            raise
        _done().write_text(str(binary()))


def _configure_and_build(source: Path, build_dir: Path) -> None:
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", TARGET, "-j", "1"],
                   check=True)


if __name__ == "__main__":
    build()
