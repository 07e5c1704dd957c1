"""The server refuses to start with an admin key that is short or a documented placeholder.

The admin key mints keys with no limits: a guessable one is a master key for anyone who read
the repository. `switchyard serve` is run as a process, as an operator would run it.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from auth.access import OpenAccess
from auth.admin_key import MIN_ADMIN_KEY_LENGTH, WeakAdminKey, check_admin_key
from auth.factory import AuthConfig, build_access
from auth.policy import KeyAccess
from tests.auth.conftest import REPO, free_port

# The placeholder deploy/k8s/secret.yaml used to ship: 43 characters, long enough to pass a
# length check alone.
OLD_K8S_PLACEHOLDER = "CHANGE-ME-replace-with-a-long-random-secret"


def _serve(admin_key: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SWITCHYARD_ADMIN_KEY": admin_key, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("SWITCHYARD_REDIS_URL", None)
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--model-id", "no-such-model",
            "--hostname", "127.0.0.1", "--port", str(free_port())]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("admin_key, reason", [
    ("admin-secret", "has 12 characters"),
    ("s" * (MIN_ADMIN_KEY_LENGTH - 1), f"has {MIN_ADMIN_KEY_LENGTH - 1} characters"),
    (OLD_K8S_PLACEHOLDER, "placeholder"),
    ("change-me-" + secrets.token_urlsafe(32), "placeholder"),
])
def test_serve_refuses_a_weak_admin_key_before_opening_its_port(admin_key: str,
                                                                reason: str) -> None:
    run = _serve(admin_key)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "invalid configuration" in run.stderr and reason in run.stderr, run.stderr[-2000:]
    assert "secrets.token_urlsafe(32)" in run.stderr  # it says how to make a good one
    assert admin_key not in run.stderr + run.stdout  # and never quotes the key
    assert "Uvicorn running" not in run.stderr  # refused before serving anything


def test_a_long_random_admin_key_turns_keys_on() -> None:
    for key in ("k" * MIN_ADMIN_KEY_LENGTH, secrets.token_urlsafe(32)):
        check_admin_key(key)
        assert isinstance(build_access(AuthConfig(admin_key=key)), KeyAccess)
    assert isinstance(build_access(AuthConfig()), OpenAccess)


def test_padding_does_not_make_a_short_key_long() -> None:
    with pytest.raises(WeakAdminKey, match="has 8 characters"):
        check_admin_key("  short-12  " + " " * MIN_ADMIN_KEY_LENGTH)
    with pytest.raises(WeakAdminKey, match="placeholder"):
        build_access(AuthConfig(admin_key=OLD_K8S_PLACEHOLDER.lower()))
