#!/usr/bin/env bash
# The GPU machine's side of the relay (scripts/gpu_sglang/pack.sh packs this machine's side).
# Run from the repository root on the lent machine; .relay/ is git-ignored, so pieces carried
# by earlier calls stay there while the machine stays warm.
#
#   bash scripts/gpu_sglang/device.sh status    # which pieces are here, each checked
#   bash scripts/gpu_sglang/device.sh install   # join, check sha256, pip install --target .relay/site
#   bash scripts/gpu_sglang/device.sh smoke     # torch 2.14.1 on the GPU, sgl_kernel imports
#   bash scripts/gpu_sglang/device.sh serve     # tiny Qwen3 on a real sglang server, one generation
#   bash scripts/gpu_sglang/device.sh test [ARGS]  # the real-server suite on the GPU (pytest ARGS)
#   bash scripts/gpu_sglang/device.sh freeze    # the machine's own package list (for the check)
#
# The runbook, one device call each, back to back after the last piece arrived (each
# writes what it saw under $OUT: summary.txt, summary.jsonl, logs, recorded answers):
#   bash scripts/gpu_sglang/device.sh stage1    # install, smoke, a server with and without CUDA graphs
#   bash scripts/gpu_sglang/device.sh stage2    # the GPU cases: every path and model, bit-exact
#   bash scripts/gpu_sglang/device.sh stage3    # paused_s beside sglang's update_weights_from_tensor
#   bash scripts/gpu_sglang/device.sh stage4    # verification's cost (benchmarks/verify.py cost)
#
# Everything installs into .relay/site, first on PYTHONPATH; the machine's own packages
# (triton, the CUDA 13 libraries, numpy, ...) are used for the rest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RELAY=.relay
SITE=$RELAY/site
export PYTHONPATH=$PWD/$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# sglang 0.5.23's wheel ships neither the Rust radix-tree core nor its sources, and its
# fallback check raises instead of falling back: ask for the Python tree core outright
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
# .pth files only work in site directories, and .relay/site is a PYTHONPATH entry: a
# sitecustomize makes it one (nvidia-cutlass-dsl puts its `cutlass` on sys.path from a .pth)
mkdir -p $RELAY/boot
echo "import site; site.addsitedir('$PWD/$SITE')" > $RELAY/boot/sitecustomize.py
export PYTHONPATH=$PWD/$RELAY/boot:$PYTHONPATH
# torch 2.14.1 on the machine's NCCL 2.28.9: preload the stub of the calls it lacks (pack.sh)
if [ -f $RELAY/ncclshim.so ] && [ ! -d $SITE/nvidia/nccl ]; then
  export LD_PRELOAD=$PWD/$RELAY/ncclshim.so${LD_PRELOAD:+:$LD_PRELOAD}
fi

status() {
  [ -f $RELAY/MANIFEST ] || { echo "relay: no MANIFEST"; return 1; }
  local have=0 want=0
  while read -r sum name; do
    [ "$name" = payload.tar ] && continue
    want=$((want + 1))
    if [ -f "$RELAY/$name" ] && [ "$(sha256sum "$RELAY/$name" | cut -d' ' -f1)" = "$sum" ]; then
      have=$((have + 1))
    else
      echo "relay: missing or damaged: $name"
    fi
  done < $RELAY/MANIFEST
  echo "relay: $have of $want pieces here"
  [ "$have" = "$want" ]
}

install() {
  if [ -f $SITE/.installed ]; then echo "relay: already installed in $SITE"; return; fi
  status
  cat $RELAY/piece.* > $RELAY/payload.tar
  (cd $RELAY && grep ' payload.tar$' MANIFEST | sha256sum -c -)
  rm -rf $RELAY/unpacked && mkdir -p $RELAY/unpacked
  tar -C $RELAY/unpacked -xf $RELAY/payload.tar
  (cd $RELAY/unpacked && sha256sum -c --quiet wheels.sha256)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE \
    $RELAY/unpacked/wheels/*.whl
  rm -rf $RELAY/unpacked $RELAY/payload.tar
  touch $SITE/.installed
  echo "relay: installed $(ls $SITE | wc -l) entries into $SITE"
}

smoke() {
  python3 - <<'PY'
import torch, time
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); t = time.perf_counter(); y = x @ x; torch.cuda.synchronize()
print("matmul ok", float(y.float().abs().mean()), f"{(time.perf_counter()-t)*1e3:.1f} ms")
import triton
print("triton", triton.__version__)
import sgl_kernel
print("sgl_kernel", sgl_kernel.__version__)
import sglang
print("sglang", sglang.__version__)
PY
}

serve() {  # serve [graphs]: one server of the tiny Qwen3, one generation (CUDA graphs with "graphs")
  local model=$RELAY/tiny-qwen3 port=${PORT:-31000} graph_args=(--disable-cuda-graph)
  [ "${1:-}" = graphs ] && graph_args=(--disable-prefill-cuda-graph --cuda-graph-max-bs-decode 8)
  [ -f "$model/config.json" ] || python3 scripts/gpu_sglang/tiny_model.py "$model"
  python3 -m sglang.launch_server --model-path "$model" --device cuda --tp 1 \
    --host 127.0.0.1 --port "$port" --skip-tokenizer-init \
    --attention-backend triton --sampling-backend pytorch "${graph_args[@]}" \
    --grammar-backend none --mem-fraction-static 0.2 --max-total-tokens 4096 \
    > $RELAY/server.log 2>&1 &
  local pid=$!
  for _ in $(seq 1 "${WAIT_S:-300}"); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
    if ! kill -0 $pid 2>/dev/null; then echo "relay: server exited"; tail -60 $RELAY/server.log; return 1; fi
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "relay: not ready"; tail -60 $RELAY/server.log; kill $pid; return 1; }
  echo "relay: server ready"
  curl -s "http://127.0.0.1:$port/generate" -H 'content-type: application/json' \
    -d '{"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
  echo
  tail -5 $RELAY/server.log
  kill $pid; wait $pid 2>/dev/null || true
}

test() {
  # p2pweights itself as a wheel (its sglang plugin is found through the entry point)
  if ls $RELAY/p2pw/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE $RELAY/p2pw/*.whl
  fi
  P2PWEIGHTS_REAL_SGLANG_DEVICE=cuda python3 -m pytest tests/real_sglang -m real_sglang \
    -p no:cacheprovider -q -rs "$@"
}

freeze() {
  python3 -m pip list --format=freeze 2>/dev/null
}

out() {  # where a stage writes what it saw: $OUT on the lent machine, else .relay/out
  local dir=${OUT:-$RELAY/out}
  mkdir -p "$dir" && echo "$dir"
}

p2pweights_here() {  # p2pweights from this working tree (src/ is first on PYTHONPATH), and a
  # dist-info that names its sglang plugins' entry points, which sglang finds plugins by
  python3 - "$SITE" <<'PY'
import pathlib, sys, tomllib
site = pathlib.Path(sys.argv[1])
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = site / "p2pweights_relay-0.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: p2pweights-relay\nVersion: 0\n")
lines = ["[sglang.srt.plugins]"] + [
    f"{name} = {target}" for name, target in project["entry-points"]["sglang.srt.plugins"].items()
]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
print("p2pweights from", pathlib.Path("src").resolve(), "plugins:", ", ".join(lines[1:]))
PY
}

stage1() {
  local dir; dir=$(out)
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } \
    | tee "$dir/summary.txt"
  freeze > "$dir/gpu-machine-packages.txt"
  install 2>&1 | tail -3 | tee -a "$dir/summary.txt"
  p2pweights_here
  smoke 2>&1 | tee -a "$dir/summary.txt"
  local t
  for mode in nographs graphs; do
    t=$(date +%s)
    if serve $mode > "$dir/serve-$mode.txt" 2>&1; then
      echo "serve $mode: ok in $(( $(date +%s) - t )) s: $(grep -o '"output_ids":[^]]*]' "$dir/serve-$mode.txt")" \
        | tee -a "$dir/summary.txt"
    else
      echo "serve $mode: FAILED (serve-$mode.txt)" | tee -a "$dir/summary.txt"
      cp $RELAY/server.log "$dir/server-$mode.log" || true
    fi
  done
}

stage2() {  # stage2 [pytest -k expression]
  local dir; dir=$(out)
  p2pweights_here
  export P2PWEIGHTS_GPU_SUMMARY=$dir/summary.jsonl P2PWEIGHTS_RECORD_ANSWERS=$dir/answers \
    P2PWEIGHTS_REAL_SGLANG_LOGS=$dir/logs P2PWEIGHTS_WRITE_DIGESTS=${P2PWEIGHTS_WRITE_DIGESTS:-1}
  P2PWEIGHTS_REAL_SGLANG_DEVICE=cuda timeout ${STAGE_S:-560} python3 -m pytest \
    tests/real_sglang/test_real_server_gpu.py tests/real_sglang/test_real_server.py \
    -m real_sglang -p no:cacheprovider -q -rs -k "${1:-not tp2 and not moving}" \
    2>&1 | tee "$dir/pytest.txt" | tail -60
  (cd "$dir" && tar -czf logs.tgz logs answers 2>/dev/null; rm -rf logs answers) || true
}

stage3() {
  local dir; dir=$(out)
  p2pweights_here
  P2PWEIGHTS_REAL_SGLANG_DEVICE=cuda timeout ${STAGE_S:-560} python3 benchmarks/gpu.py real-colocated --out "$dir/colocated.json" "$@" 2>&1 \
    | tee "$dir/colocated.txt" | tail -40
}

stage4() {  # verification's cost on this GPU (issue 40): off, on, as-written, in turns
  local dir; dir=$(out)
  timeout ${STAGE_S:-560} python3 benchmarks/verify.py cost --device cuda --repeats 8 --no-doc \
    --models qwen3-1g:staged:256MiB qwen3-1g:staged:1GiB qwen3-4b-shape:direct:2GiB \
    --out "$dir/verify_cost.json" "$@" 2>&1 | tee "$dir/verify_cost.txt" | tail -30
}

cmd=${1:-status}
shift || true
"$cmd" "$@"
