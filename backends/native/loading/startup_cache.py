"""The startup cache: what is slow to recompute at load, kept on disk between starts.

Layout under the cache directory (`--cache-dir` / `SWITCHYARD_CACHE_DIR`, default
`~/.cache/switchyard`):

    models/<file key>/metadata-<reader>.json parsed GGUF metadata and config
    models/<file key>/tokenizer-<reader>/    the converted GGUF tokenizer (save_pretrained)
    models/<file key>/weights-<variant>/     built quantized modules (weight_cache.py)
    inductor/<cpu kind>/                     torch.compile's own cache (TORCHINDUCTOR_CACHE_DIR)

Every entry is written under a temporary name and renamed into place, so a reader sees a
whole entry or none. An entry that cannot be read is removed with a warning and rebuilt: the
cache can make a start faster, never make it fail.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from backends.native.loading.load_progress import current_tracker

log = logging.getLogger(__name__)

_SAMPLE_BYTES = 1 << 20  # hashed from each end of the file
_T = TypeVar("_T")


def file_key(path: str) -> str:
    """A key that changes when the file does: size, mtime and a sha256 of its first and last
    MiB. Constant time (a full sha256 costs ~1.4 s/GB; GGUF files run to many GB)."""
    stat = os.stat(path)
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, stat.st_size - _SAMPLE_BYTES))
        digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


class StartupCache:
    """One model file's entries under `root`."""

    def __init__(self, root: Path, key: str) -> None:
        self.root = root
        self.dir = root / "models" / key

    def path(self, name: str) -> Path:
        return self.dir / name

    def read_json(self, name: str) -> dict[str, Any] | None:
        """The entry's content, or None when it is missing or unreadable (then removed)."""
        return self.read(name, _read_json)

    def write_json(self, name: str, content: dict[str, Any]) -> None:
        def write(tmp: Path) -> None:
            tmp.write_text(json.dumps(content), encoding="utf-8")

        self.publish(name, write, is_dir=False)

    def read(self, name: str, reader: Callable[[Path], _T]) -> _T | None:
        path = self.path(name)
        if not path.exists():
            return None
        try:
            return reader(path)
        except Exception as exc:  # noqa: BLE001 - any damage means "rebuild", never a crash
            log.warning("startup cache: ignoring unreadable entry %s (%s); rebuilding it",
                        path, _one_line(exc))
            self.discard(name)
            return None

    def publish(self, name: str, writer: Callable[[Path], None], is_dir: bool = True) -> None:
        """Write an entry through `writer(tmp)` (a folder, or a file when not `is_dir`), then
        rename it into place; failures (a read-only or full disk) are logged and the start
        goes on uncached."""
        target = self.path(name)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.dir))
            try:
                if is_dir:
                    writer(tmp)
                    _rename_dir(tmp, target)
                else:
                    writer(tmp / name)
                    os.replace(tmp / name, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is no cache
            log.warning("startup cache: cannot write %s (%s)", target, _one_line(exc))

    def discard(self, name: str) -> None:
        path = self.path(name)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def open_cache(root: Path | None, model_path: str) -> StartupCache | None:
    """The cache for `model_path` (a file; folders load fast and are not cached), or None
    when the cache is off (`root` None)."""
    if root is None or not os.path.isfile(model_path):
        return None
    try:
        return StartupCache(root, file_key(model_path))
    except OSError as exc:
        log.warning("startup cache: cannot hash %s (%s); loading uncached", model_path, exc)
        return None


_READER_SOURCES = ("native/loading/loader.py", "native/loading/gguf_reader.py",
                   "native/loading/gguf_experts.py", "native/loading/gguf_rope.py",
                   "native/loading/tokenizer_loading.py", "text/tokenizer.py")
_READER_PACKAGES = ("transformers", "tokenizers", "gguf")


@functools.cache
def reader_version() -> str:
    """Names the code that parses a GGUF file and converts its tokenizer (our readers and the
    libraries they use): a change to any of them must not read entries the old one wrote."""
    digest = hashlib.sha256()
    folder = Path(__file__).resolve().parents[2]  # backends/
    for name in _READER_SOURCES:
        digest.update((folder / name).read_bytes())
    for package in _READER_PACKAGES:
        digest.update(f"{package}=={importlib.metadata.version(package)}".encode())
    return digest.hexdigest()[:12]


class LoadStages:
    """Times the load stages and logs one line each: `load: tokenizer 0.31s (cached)`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cached: dict[str, bool] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[dict[str, bool]]:
        """The yielded dict's "cached" flag is set by the stage when it was served from
        the cache."""
        flags = {"cached": False}
        tracker = current_tracker()  # /health and /info show the stage (load_progress.py)
        if tracker is not None:
            tracker.begin(name)
        start = time.perf_counter()
        yield flags
        elapsed = time.perf_counter() - start
        self.seconds[name], self.cached[name] = elapsed, flags["cached"]
        if tracker is not None:
            tracker.end(name, elapsed, flags["cached"])
        log.info("load: %s %.2fs%s", name, elapsed, " (cached)" if flags["cached"] else "")


def _read_json(path: Path) -> dict[str, Any]:
    content = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(content, dict):
        raise ValueError("not a JSON object")
    return content


def _rename_dir(tmp: Path, target: Path) -> None:
    if target.exists():  # a damaged entry (a whole one would have been read instead)
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.exists():  # else a concurrent start published it first: keep theirs
            raise


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
