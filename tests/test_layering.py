"""gateway/, auth/ and routing/ never import torch: only a native or transformers backend,
created at startup, brings it in (backends/registry.py imports them lazily)."""

from __future__ import annotations

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
