#!/usr/bin/env bash
# The demo: set up (idempotent), start two local engines (TP 2 and TP 1), push three updates
# from a trainer process and verify every engine rank bit-exactly. Extra arguments go to
# `p2pweights demo` (e.g. --transport nixl).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/p2pweights demo "$@"
