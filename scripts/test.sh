#!/usr/bin/env bash
# The test command: set up (idempotent), lint, format check, type check, then the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
echo "== ruff check";  .venv/bin/ruff check src tests benchmarks
echo "== ruff format"; .venv/bin/ruff format --check src tests benchmarks
echo "== mypy";        .venv/bin/mypy
echo "== pytest";      .venv/bin/python -m pytest "$@"
