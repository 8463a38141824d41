#!/usr/bin/env bash
# Install everything p2pweights needs on a fresh Debian machine (root, Python 3.11, no GPU):
# the RDMA user-space libraries Mooncake links against, a venv in .venv, pinned Python
# packages (torch 2.14.1, sglang 0.5.23 without its CUDA kernels, Mooncake, NIXL, the docs
# build's mkdocs) and p2pweights itself in editable mode. Safe to run again: it skips what
# is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS="libibverbs1 librdmacm1 ibverbs-providers libnuma1"
if ! dpkg -s $DEBS >/dev/null 2>&1; then
  echo "setup: installing Debian packages: $DEBS"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $DEBS >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi

# The editable install's metadata carries the version: reinstall when it changes too.
want=$( (cat pyproject.toml requirements/*.txt; grep '^__version__' src/p2pweights/__init__.py) \
  | sha256sum | cut -c1-64)
stamp=.venv/.p2pweights-setup
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
  echo "setup: installing pinned Python packages (torch first; a few minutes on a fresh machine)"
  "${pip[@]}" torch==2.14.1
  "${pip[@]}" -r requirements/runtime-lock.txt
  # the documentation build the test command runs (mkdocs, mkdocstrings)
  "${pip[@]}" -c requirements/runtime-lock.txt -r requirements/docs-lock.txt
  "${pip[@]}" --no-deps -r requirements/nodeps.txt
  # the lock holds the [engine] extra's fastapi and uvicorn: the tests and the demo serve
  # local engines
  "${pip[@]}" --no-deps -e ".[engine]"
  echo "$want" > "$stamp"
fi
echo "setup: ready ($(.venv/bin/python -c 'import fastapi, uvicorn, torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)'))"
