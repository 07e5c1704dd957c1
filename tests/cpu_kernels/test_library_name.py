"""The kernel library's cached name: the same sources, flags and torch version give the same
name wherever torch and the sources are installed (a fresh clone or another venv reuses the
library instead of rebuilding it, ~70 s on 2 cores); anything that changes the code changes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from backends.cpu_kernels import build

SPEC = build.KernelBuild("avx2")


def _torch_installed_at(monkeypatch: pytest.MonkeyPatch, site_packages: Path) -> None:
    root = site_packages / "torch"
    monkeypatch.setattr(torch, "__file__", str(root / "__init__.py"))
    monkeypatch.setattr(cpp_extension, "include_paths",
                        lambda *_: [str(root / "include"),
                                    str(root / "include/torch/csrc/api/include")])
    monkeypatch.setattr(cpp_extension, "library_paths", lambda *_: [str(root / "lib")])


def test_the_name_does_not_depend_on_where_torch_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _torch_installed_at(monkeypatch, Path("/one/venv/lib/python3.11/site-packages"))
    first = build.library_name(SPEC)
    _torch_installed_at(monkeypatch, Path("/another/clone/.venv/lib/python3.11/site-packages"))
    assert build.library_name(SPEC) == first


def test_torch_version_and_flags_change_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    first = build.library_name(SPEC)
    assert build.library_name(build.KernelBuild("avx2", extra_flags=("-DEXTRA",))) != first
    assert build.library_name(build.KernelBuild("avx512-vnni")) != first
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert build.library_name(SPEC) != first
