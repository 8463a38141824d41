#!/usr/bin/env bash
# A real sglang 0.5.23 server on this machine's CPU, for the `real_sglang` test suite.
#
#   bash scripts/real-sglang.sh build        # build sglang's CPU kernel once into the cache
#   bash scripts/real-sglang.sh test [ARGS]  # build if needed, then pytest -m real_sglang ARGS
#   bash scripts/real-sglang.sh env          # print the exports that point tests at the kernel
#
# The kernel's sources come from sglang's git history at commit $COMMIT below (upstream
# main as of 2026-08-21, about two months before 0.5.23): a git clone of sglang with that
# commit, by default in the cache below, once:
#   git clone https://github.com/sgl-project/sglang ~/.cache/p2pweights/real-sglang/sglang
#   git -C ~/.cache/p2pweights/real-sglang/sglang checkout 44806dc507835746b67abebad041726c422030ea
# or elsewhere, named by SGLANG_SNAPSHOT (the clone's git directory, e.g. .../sglang/.git).
# Two attention kernels changed their signature before 0.5.23;
# scripts/real_sglang/compat.patch adapts them (bf16 KV cache, causal only).
# The build takes 15-30 minutes on 2 cores and leaves a 5 MB package in
# $P2PWEIGHTS_REAL_SGLANG_CACHE (default ~/.cache/p2pweights/real-sglang); it is reused
# until the snapshot, the patch, torch or sglang change. docs/real-sglang.md says more.
set -euo pipefail
cd "$(dirname "$0")/.."

COMMIT=44806dc507835746b67abebad041726c422030ea
CACHE=${P2PWEIGHTS_REAL_SGLANG_CACHE:-$HOME/.cache/p2pweights/real-sglang}
SNAPSHOT=${SGLANG_SNAPSHOT:-$CACHE/sglang/.git}
AOT=python/sglang/kernels/aot
PY=.venv/bin/python

bash scripts/setup.sh >/dev/null

# What the server needs beyond the trainer's packages (held to the lock's versions).
extras=(jsonschema xgrammar==0.2.7 soundfile==0.13.1)
if ! "$PY" -c 'import jsonschema, xgrammar, soundfile' 2>/dev/null; then
  echo "real-sglang: installing the server's extra packages: ${extras[*]}"
  "$PY" -m pip install -q --disable-pip-version-check -c requirements/runtime-lock.txt "${extras[@]}"
fi
debs="libnuma-dev numactl ninja-build patch"
if ! dpkg -s $debs >/dev/null 2>&1; then
  echo "real-sglang: installing Debian packages: $debs"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $debs >/dev/null
fi

versions=$("$PY" -c 'import torch, sglang; print(f"torch{torch.__version__}-sglang{sglang.__version__}")')
key=$( (echo "$COMMIT $versions"; cat scripts/real_sglang/compat.patch scripts/real_sglang/build_kernel.py) \
  | sha256sum | cut -c1-12)
KERNEL_DIR=$CACHE/sgl_kernel-${COMMIT:0:9}-$key

build() {
  if [ -f "$KERNEL_DIR/BUILT" ]; then
    echo "real-sglang: kernel already built in $KERNEL_DIR"
    return
  fi
  if ! git --git-dir="$SNAPSHOT" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
    echo "real-sglang: sglang's CPU kernel is built from sglang's git history at commit" >&2
    echo "  $COMMIT, and $SNAPSHOT has no such commit." >&2
    echo "  Clone it once (about 1 GB), then run this again:" >&2
    echo "    git clone https://github.com/sgl-project/sglang $CACHE/sglang" >&2
    echo "    git -C $CACHE/sglang checkout $COMMIT" >&2
    echo "  (or set SGLANG_SNAPSHOT to the git directory of a clone that has it; docs/real-sglang.md)" >&2
    exit 2
  fi
  work=$(mktemp -d "${TMPDIR:-/tmp}/p2pweights-sgl-kernel.XXXXXX")
  trap 'rm -rf "$work"' RETURN
  git --git-dir="$SNAPSHOT" archive "$COMMIT" "$AOT/csrc" "$AOT/include" "$AOT/python/sgl_kernel" \
    | tar -x -C "$work"
  patch -s "$work/$AOT/csrc/cpu/torch_extension_cpu.cpp" scripts/real_sglang/compat.patch
  echo "real-sglang: building sglang's CPU kernel from $COMMIT (15-30 min on 2 cores;" \
    "log: $work/build.log until it ends)"
  start=$(date +%s)
  root=$PWD
  if ! (cd "$work" && SGL_AOT_DIR="$work/$AOT" MAX_JOBS=${MAX_JOBS:-2} \
      "$root/$PY" "$root/scripts/real_sglang/build_kernel.py" build_ext -b "$work/out") \
      >"$work/build.log" 2>&1; then
    tail -40 "$work/build.log" >&2
    mkdir -p "$CACHE" && cp "$work/build.log" "$CACHE/last-failed-build.log"
    echo "real-sglang: the build failed; the log is in $CACHE/last-failed-build.log" >&2
    exit 1
  fi
  mkdir -p "$KERNEL_DIR.tmp/sgl_kernel"
  cp -r "$work/$AOT/python/sgl_kernel/." "$KERNEL_DIR.tmp/sgl_kernel/"
  for so in "$work"/out/sgl_kernel/common_ops*.so; do
    strip --strip-debug -o "$KERNEL_DIR.tmp/sgl_kernel/$(basename "$so")" "$so"
  done
  printf 'sglang %s\n%s\npatch %s\nbuilt in %s s on %s\n' \
    "$COMMIT" "$versions" "$(sha256sum scripts/real_sglang/compat.patch | cut -c1-12)" \
    "$(( $(date +%s) - start ))" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" \
    > "$KERNEL_DIR.tmp/BUILT"
  rm -rf "$KERNEL_DIR" && mv "$KERNEL_DIR.tmp" "$KERNEL_DIR"
  echo "real-sglang: kernel built in $KERNEL_DIR ($(cat "$KERNEL_DIR/BUILT" | tail -1))"
}

case "${1:-test}" in
  build) build ;;
  env) echo "export P2PWEIGHTS_SGL_KERNEL_DIR=$KERNEL_DIR" ;;
  test)
    shift || true
    build
    export P2PWEIGHTS_SGL_KERNEL_DIR=$KERNEL_DIR
    exec "$PY" -m pytest -m real_sglang tests/real_sglang "$@"
    ;;
  *) echo "usage: $0 [build|test|env] [pytest args]" >&2; exit 2 ;;
esac
