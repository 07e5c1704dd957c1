"""docker-compose.yml as Debian's `docker-compose` reads it (`config`: variables
substituted, anchors merged), with the secrets an operator exports."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_CUDA = REPO / "docker-compose.cuda.yml"
# What an operator exports before `docker compose up` (the file's header says how).
SECRETS = {"SWITCHYARD_ADMIN_KEY": "sy-admin-" + "a-long-random-secret" * 2,
           "REDIS_PASSWORD": "0123456789abcdef" * 4}


def compose(*args: str, env: dict[str, str], files: tuple[Path, ...] = (COMPOSE,),
            ) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (scripts/setup.sh installs it with apt-get)")
    named = [arg for path in files for arg in ("-f", str(path))]
    return subprocess.run([binary, *named, *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)


def compose_services(secrets: dict[str, str] = SECRETS,
                     files: tuple[Path, ...] = (COMPOSE,)) -> dict[str, Any]:
    """The services of `docker-compose config` with `secrets` in the environment."""
    result = compose("config", env={**os.environ, **secrets}, files=files)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]
