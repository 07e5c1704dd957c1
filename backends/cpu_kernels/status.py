"""Which of our CPU kernels this process runs, as `/info` (`cpu_kernels`) and the startup log
report it: `avx512-bf16` (AVX-512 VNNI with the bf16 extension built in), `avx512` (AVX-512
VNNI without it), `avx2`, or `none (<why>)`.

`SWITCHYARD_CPU_KERNELS` (`switchyard serve --cpu-kernels` sets it) picks: `auto` (default) the
best code this CPU and torch's dispatch allow, `required` the same but a CPU model's load fails
where none can be built or loaded, `avx512-vnni` / `avx2` that code only (tests, A/B
benchmarks), `off` torch's kernels. It is read when the kernels are first needed (a model's
load), never at import.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

SETTING = "SWITCHYARD_CPU_KERNELS"
BUILD_VARIANTS = ("avx512-vnni", "avx2")  # the code a library is built with
SETTINGS = ("auto", "required", "off", *BUILD_VARIANTS)

Reported = Literal["avx512-bf16", "avx512", "avx2", "none"]


class KernelsUnavailable(RuntimeError):
    """`required`, and no variant could be built or loaded (or none fits this machine)."""


@dataclass(frozen=True)
class KernelStatus:
    """The kernels loaded in this process, or why none are."""

    variant: Reported
    build: str | None = None  # the build variant loaded (BUILD_VARIANTS); None: none
    reason: str = ""  # why none: the setting, the CPU, torch's dispatch or the build

    @property
    def active(self) -> bool:
        return self.build is not None

    def describe(self) -> str:
        """`avx512-bf16`, ..., or `none (<why>)`: the form /info and the log use."""
        return self.variant if self.active else f"none ({self.reason})"


def loaded(build: str, bf16_built: bool) -> KernelStatus:
    if build == "avx2":
        return KernelStatus("avx2", build)
    return KernelStatus("avx512-bf16" if bf16_built else "avx512", build)


def unavailable(reason: str) -> KernelStatus:
    return KernelStatus("none", None, reason)


def read_setting() -> str:
    """The setting now (the environment is the single source); ValueError for an unknown one."""
    return normalize(os.environ.get(SETTING, ""))


def normalize(setting: str) -> str:
    setting = setting.strip().lower() or "auto"
    if setting not in SETTINGS:
        raise ValueError(f"{SETTING}={setting!r}: choose one of {', '.join(SETTINGS)}")
    return setting


def require(status: KernelStatus, setting: str | None = None) -> KernelStatus:
    """`status`, or KernelsUnavailable where the setting (read now unless given) is
    `required` and no kernels run."""
    if (setting or read_setting()) == "required" and not status.active:
        raise KernelsUnavailable(f"--cpu-kernels required ({SETTING}=required): "
                                 f"{status.reason}")
    return status


# g++'s echo of the offending source line and its caret (`   12 | #include "simd.h"`).
_SOURCE_ECHO = re.compile(r"^\s*\d*\s*\|")
_NOISE = ("compilation terminated.", "In file included from", "from ")


def compiler_message(stderr: str, lines: int = 3) -> str:
    """The last meaningful lines of a compiler's or linker's stderr: without the echoed
    source, its carets, include chains, notes and `compilation terminated.`."""
    meaningful = [line.strip() for line in stderr.splitlines()
                  if line.strip() and not _SOURCE_ECHO.match(line)
                  and not line.strip().startswith(_NOISE) and ": note: " not in line]
    return " / ".join(meaningful[-lines:]) or "no message"
