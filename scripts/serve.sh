#!/usr/bin/env bash
# Set up (if needed) and serve the default model on 127.0.0.1:8080. Extra flags pass through.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/switchyard serve --model-id default --hostname 127.0.0.1 --port 8080 "$@"
