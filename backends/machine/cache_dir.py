"""Where Switchyard keeps what it builds or converts once per machine: the cache directory
(`--cache-dir` / `SWITCHYARD_CACHE_DIR`), and torch.compile's folder per CPU kind below it."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

DEFAULT_CACHE_DIR = "~/.cache/switchyard"
DISABLED = ("", "none", "off")


def cache_root(setting: str | None) -> Path | None:
    """The cache directory a `--cache-dir` value names; None: off ("", "none", "off")."""
    if setting is None or setting.strip().lower() in DISABLED:
        return None
    return Path(setting).expanduser()


def point_inductor_cache(root: Path | None, machine: str) -> None:
    """torch.compile keeps its artifacts in a folder per CPU kind, below the one the user chose
    (TORCHINDUCTOR_CACHE_DIR), else below ours, else below torch's temp default. Inductor's
    own keys miss the CPU capability: a kernel compiled without `ATEN_CPU_CAPABILITY=avx2`
    and reused under it decoded wrong tokens. torch writes its default into the variable the
    first time it reads it, so that value counts as unset here."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    torch_default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    if current is not None and Path(current).name == machine:
        return
    if current is None or Path(current) == torch_default:
        base = root / "inductor" if root is not None else torch_default
    else:
        base = Path(current)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / machine)
