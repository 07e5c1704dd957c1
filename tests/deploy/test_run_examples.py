"""The images listen on 0.0.0.0, so every way the repository shows to run one sets an admin
key: with none, the gateway is open to whoever reaches the port. A key shown is generated
on the spot (never a literal someone could copy), as the server refuses short or
placeholder keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = ["Dockerfile", "Dockerfile.cuda", "README.md", "deploy/README.md",
             "envoy/README.md", "docker-compose.yml", "docker-compose.cuda.yml"]
GENERATED = re.compile(r"\$\((python3 -c 'import secrets; print\(secrets\.token_urlsafe\(\d+\)\)'"
                       r"|openssl rand -(base64|hex) \d+)\)")


def _run_commands(text: str) -> list[str]:
    """`docker run ...` examples (in comments or code blocks), continuation lines joined."""
    commands, current = [], ""
    for line in text.splitlines():
        line = line.lstrip("#").strip()
        if current or line.startswith("docker run"):
            current += line.rstrip("\\") + " "
            if not line.endswith("\\"):
                commands.append(current.strip())
                current = ""
    return commands


def test_the_images_listen_on_every_interface() -> None:  # why the examples need a key
    for name in ("Dockerfile", "Dockerfile.cuda"):
        assert '"--hostname", "0.0.0.0"' in (REPO / name).read_text(), name


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_each_image_shows_how_to_run_it(name: str) -> None:
    assert _run_commands((REPO / name).read_text()), name


def test_every_run_example_sets_a_generated_admin_key() -> None:
    for name in DOCUMENTS:
        for command in _run_commands((REPO / name).read_text()):
            key = re.search(r"SWITCHYARD_ADMIN_KEY=(\S+(?: \S+)*?\)\"?)", command)
            assert key, (name, command)
            assert GENERATED.search(key.group(1)), (name, command)


def test_every_serve_example_on_all_interfaces_sets_a_key() -> None:
    for name in DOCUMENTS:
        text = (REPO / name).read_text()
        for match in re.finditer(r"switchyard serve[^\n]*--hostname 0\.0\.0\.0", text):
            before = text[max(0, match.start() - 600):match.start()]
            assert "SWITCHYARD_ADMIN_KEY" in before, (name, match.group(0))
