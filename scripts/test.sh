#!/usr/bin/env bash
# Set up (if needed), lint, and run the tests single-threaded (the 30 slowest listed at the end,
# to keep the suite's time in view). Extra args go to pytest.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

lint_rc=0
.venv/bin/ruff check . || lint_rc=$?

test_rc=0
.venv/bin/python -m pytest -q --durations=30 "$@" || test_rc=$?

if [[ $test_rc -eq 5 ]]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
    test_rc=1
fi
if [[ $lint_rc -ne 0 ]]; then
    echo "test.sh: ruff check failed (exit $lint_rc)" >&2
fi
if [[ $test_rc -ne 0 ]]; then
    echo "test.sh: pytest failed (exit $test_rc)" >&2
    exit "$test_rc"
fi
exit "$lint_rc"
