#!/usr/bin/env bash
# The test command: set up (idempotent), lint, format check, type check, the documentation
# site with warnings as errors (broken links, docstrings naming parameters a signature
# lacks), build and check the package, then the test suite against the built wheel
# installed apart from the source tree.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not integration"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
echo "== ruff check";  .venv/bin/ruff check src tests benchmarks scripts examples
echo "== ruff format"; .venv/bin/ruff format --check src tests benchmarks scripts examples
echo "== mypy";        .venv/bin/mypy

# A folder of this run's own (other runs in the same checkout may build at the same time).
pkg=$(mktemp -d "${TMPDIR:-/tmp}/p2pweights-package.XXXXXX")
trap 'rm -rf "$pkg"' EXIT
echo "== docs: mkdocs build --strict (mkdocs.yml; the API reference from the docstrings)"
.venv/bin/mkdocs build --strict --quiet --site-dir "$pkg/site-docs"

echo "== package: sdist, wheel built from it, twine check, wheel installed in $pkg/site"
if ! .venv/bin/python -m build --no-isolation --outdir "$pkg/dist" . >"$pkg/build.log" 2>&1; then
  cat "$pkg/build.log"
  exit 1
fi
.venv/bin/python -m twine check --strict "$pkg"/dist/*
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$pkg/site" \
  "$pkg"/dist/*.whl

echo "== pytest"
.venv/bin/python scripts/pytest_installed.py "$pkg/site" "$@"
