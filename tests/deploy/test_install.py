"""A non-editable install (`pip install .`, as the Dockerfile does) carries everything the
package reads at run time: the kernel sources and headers build from site-packages and the
default model loads with our CPU kernels active, from outside the repository.

The install is offline and quick: a fresh venv sees the dev venv's site-packages for the
dependencies (a .pth line) and pip installs a copy of the tree with --no-deps
--no-build-isolation --no-index. The kernel library is named by the content of every source
and header it is built from, so naming it reads them all from site-packages: a file left out
fails the load even where the library is already cached (built by the suite's other tests)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from backends.cpu_kernels.build import kernel_status
from backends.default_model import default_model_path

ROOT = Path(__file__).parents[2]
PACKAGES = ("gateway", "auth", "routing", "backends")  # the Dockerfile copies these
CHECK = Path(__file__).with_name("installed_check.py")
FINGERPRINTS = (
    "import json, backends\n"
    "from backends.native.loading.startup_cache import reader_version\n"
    "from backends.native.loading.weight_cache import _code_fingerprint\n"
    "print(json.dumps({'backends': backends.__file__, 'reader_version': reader_version(),"
    " 'code_fingerprint': _code_fingerprint()}))\n"
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the Dockerfile copies (the tree may change under a long run)."""
    folder = tmp_path_factory.mktemp("install") / "src"
    folder.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, folder / name)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, folder / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return folder


@pytest.fixture(scope="module")
def installed(source: Path) -> Path:
    """The site-packages folder of a fresh venv with the package installed (not editable)."""
    venv = source.parent / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    target = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages"
    # A path line only: the dev venv's .pth files (its editable finder among them) stay unread.
    (target / "dev_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps",
         "--no-build-isolation", "--no-index", "--no-cache-dir", "--disable-pip-version-check",
         str(source)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return target


def _package_files(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for name in PACKAGES for path in (root / name).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def _clean_env(**settings: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {**env, **settings}


def test_every_package_file_is_installed(source: Path, installed: Path) -> None:
    missing = _package_files(source) - _package_files(installed)
    assert not missing, f"left out of a non-editable install: {sorted(missing)}"


def test_the_installed_package_builds_and_runs_the_cpu_kernels(
        source: Path, installed: Path, tmp_path: Path) -> None:
    expected = kernel_status()
    if not expected.active:
        pytest.skip(f"no CPU kernels here either: {expected.describe()}")
    try:
        default_model_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    elsewhere = tmp_path / "elsewhere"  # not the repository: its tree must not be importable
    elsewhere.mkdir()
    env = _clean_env(SWITCHYARD_CPU_KERNELS="auto", OMP_NUM_THREADS="1")
    done = subprocess.run([str(installed.parents[2] / "bin" / "python"), "-I", str(CHECK)],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["backends"]).is_relative_to(installed), report["backends"]
    assert report["cpu_kernels"] == expected.describe(), done.stderr[-3000:]
    assert len(report["tokens"]) == 3
    # Both read the package's .py files by path: the copied tree gives the same fingerprints.
    assert {key: report[key] for key in ("reader_version", "code_fingerprint")} == \
        _fingerprints_of(source)


def _fingerprints_of(tree: Path) -> dict[str, str]:
    """The weight and startup caches' code fingerprints of the sources in `tree`."""
    done = subprocess.run([sys.executable, "-c", FINGERPRINTS], cwd=tree, env=_clean_env(),
                          capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report.pop("backends")).is_relative_to(tree), report
    return report
