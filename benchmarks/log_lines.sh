#!/bin/bash
# Lines a user sees on stderr (issue 31, "Quiet by default"): a trainer doing connect +
# update against one local engine, the local engine's start (until it serves), and
# `p2pweights plan`. Usage: bash benchmarks/log_lines.sh [OUT_DIR]; prints the counts,
# the lines themselves are left in OUT_DIR. Run from the repository root.
set -u
OUT=${1:-$(mktemp -d /tmp/p2pweights-log-lines-XXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
$PY -c "from p2pweights.testing import write_model_dir; write_model_dir('qwen3-tiny', '$OUT/model')" >/dev/null 2>&1
cat >"$OUT/trainer.py" <<'PYEOF'
import sys

import torch

from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
from p2pweights.testing import synthetic_weights

url, model = sys.argv[1], sys.argv[2]
weights = list(synthetic_weights(model, seed=1, dtype=torch.bfloat16))
with WeightSyncSession(SyncConfig(transport=MooncakeConfig(protocol="tcp"))) as session:
    session.connect([url])
    report = session.update(weights)
print("updated to version", report.version)
PYEOF
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$PY -m p2pweights.cli engine --model "$OUT/model" --tp 1 --port "$PORT" --seed 0 >"$OUT/engine.out" 2>"$OUT/engine.err" &
ENGINE=$!
for _ in $(seq 1 600); do curl -s -o /dev/null "http://127.0.0.1:$PORT/health" && break; sleep 0.5; done
sleep 1
cp "$OUT/engine.err" "$OUT/engine_start.err"
$PY "$OUT/trainer.py" "http://127.0.0.1:$PORT" "$OUT/model" >"$OUT/trainer.out" 2>"$OUT/trainer.err"
kill "$ENGINE"; wait "$ENGINE" 2>/dev/null
$PY -m p2pweights.cli plan --model "$OUT/model" --engine tp=2 --senders 2 >"$OUT/plan.out" 2>"$OUT/plan.err"
for f in engine_start trainer plan; do echo "$f: $(wc -l <"$OUT/$f.err") line(s) on stderr"; done
echo "lines in $OUT"
