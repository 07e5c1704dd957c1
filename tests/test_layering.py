"""gateway/, auth/ and routing/ never import torch: only a native or transformers backend,
created at startup, brings it in (backends/registry.py imports them lazily)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE = ("gateway", "auth", "routing")


def _modules() -> list[str]:
    names = []
    for package in TORCH_FREE:
        names.append(package)
        for module in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
            names.append(module.name)
    return names


def test_gateway_auth_and_routing_import_no_torch() -> None:
    modules = _modules()
    assert "gateway.openai.routes" in modules and "routing.router" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-500:]


# Who may import whom inside backends/: a package imports only from the packages named for it
# (and from itself). The native engine's parts are layered bottom-up; the kernels, the shared
# text helpers and the machine facts sit below every backend; sibling backends never reach
# into native/.
BACKEND_LAYERS: dict[str, frozenset[str]] = {
    "machine": frozenset(),
    "text": frozenset({"base"}),
    "cpu_kernels": frozenset({"machine"}),
    "quantized": frozenset({"base", "cpu_kernels", "machine"}),
    "native.structured": frozenset({"base", "text"}),
    "native.layers": frozenset({"cpu_kernels", "machine", "quantized"}),
    "native.models": frozenset({"native.layers", "cpu_kernels", "quantized"}),
    "native.loading": frozenset({
        "native.config", "native.models", "native.layers", "text", "machine", "quantized",
        "cpu_kernels", "default_model", "generation_config", "base", "pooling"}),
    "native.scheduling": frozenset({"base", "native.config", "native.structured", "text"}),
    "native.sampling": frozenset({
        "native.scheduling", "native.structured", "text", "cpu_kernels", "base"}),
    "native.runner": frozenset({
        "native.scheduling", "native.sampling", "native.layers", "native.models",
        "native.loading", "native.config", "cpu_kernels", "quantized", "base"}),
    "transformers": frozenset({
        "base", "text", "machine", "default_model", "generation_config", "events", "torch_thread",
        "quantized", "registry", "embeddings", "pooling"}),
    "tgi": frozenset({"base", "text", "events", "remote"}),
    "remote": frozenset({"base", "events", "embeddings"}),
}


def _imported_backend_packages(path: Path) -> set[str]:
    """The backends.* packages a module imports, as `native.layers`, `text`, `base`, ..."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != "backends" or len(parts) < 2:
                continue
            depth = 3 if parts[1] == "native" and len(parts) > 2 else 2
            found.add(".".join(parts[1:depth]))
    return found


def _package_of(path: Path) -> str:
    parts = path.relative_to(ROOT / "backends").with_suffix("").parts
    if parts[0] == "native" and len(parts) > 2:
        return f"native.{parts[1]}"
    return parts[0] if len(parts) > 1 else parts[0]


def test_backend_packages_import_only_what_lies_below_them() -> None:
    wrong: list[str] = []
    checked: set[str] = set()
    for path in sorted((ROOT / "backends").rglob("*.py")):
        package = _package_of(path)
        allowed = BACKEND_LAYERS.get(package)
        if allowed is None:
            continue
        checked.add(package)
        for imported in _imported_backend_packages(path) - {package}:
            if imported not in allowed:
                wrong.append(f"{path.relative_to(ROOT)} imports backends.{imported}")
    assert checked == set(BACKEND_LAYERS), set(BACKEND_LAYERS) - checked
    assert not wrong, "\n".join(wrong)


def test_kernels_and_sibling_backends_import_nothing_of_native() -> None:
    for package in ("cpu_kernels", "machine", "text", "quantized", "transformers", "tgi",
                    "remote"):
        for path in (ROOT / "backends" / package).rglob("*.py"):
            imported = _imported_backend_packages(path)
            assert not any(p.startswith("native") for p in imported), path
