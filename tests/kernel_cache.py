"""The CPU kernel library for tests that start servers in their own processes: built once in
the test process (no server's readiness deadline waits on a ~70 s build), and linked into a
fresh cache folder for the tests that start on one to check the other caches."""

from __future__ import annotations

from pathlib import Path

import torch

from backends.cpu_kernels.build import KernelBuild, built_library, suitable_variant
from backends.cpu_kernels.status import read_setting
from backends.machine.cpu_dtype import read_cpuinfo


def machine_kernels() -> Path | None:
    """The library this machine's processes load (built here if need be), or None where
    none fits this CPU, torch's dispatch or the setting."""
    variant = suitable_variant(read_cpuinfo()[1], torch.backends.cpu.get_cpu_capability(),
                               read_setting())
    return None if variant is None else built_library(KernelBuild(variant))


def seed_kernels(cache_dir: Path) -> None:
    """Links the machine's kernel library into `cache_dir`'s kernel folder."""
    library = machine_kernels()
    if library is None:
        return
    folder = cache_dir / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / library.name
    if not link.exists():
        link.symlink_to(library)
