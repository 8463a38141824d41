#!/usr/bin/env bash
# Pack what a lent GPU machine needs to run a real sglang 0.5.23 server, in pieces small
# enough to travel one per device call (see docs/real-sglang.md, "On the GPU").
#
#   bash scripts/gpu_sglang/pack.sh          # fills .relay/ (git-ignored), idempotent
#
# The GPU machine reaches no package registry and has torch 2.11; sglang 0.5.23 needs
# torch 2.14.1 and its kernel package. What goes into the payload:
#   * torch 2.14.1 (cp312, manylinux_2_28, CUDA 13.0 build, ~555 MB), from PyPI;
#   * sglang-kernel 0.4.10 without flash_ops.abi3.so (FA3, 1.1 GB unpacked: only its
#     attention backend imports it; the server runs with --attention-backend triton) and
#     without sm100/ (Blackwell), repacked (~21 MB);
#   * what torch 2.14.1 needs newer than the machine has: NCCL (the machine's 2.28.9 lacks
#     ncclCommResume and 10 other symbols libtorch_cuda.so binds at load: a 14 kB stub of
#     them, nccl_shim.c, is preloaded there; CARRY_NCCL=1 carries nvidia-nccl-cu13 2.30.7,
#     216 MB, instead) and torchvision 0.29.1 (the machine's 0.26 is built for torch 2.11, and
#     transformers imports it);
#   * the wheels `benchmarks/device_wheels.sh` gathers (sglang itself, transformers 5.19,
#     pydantic, fastapi, ...), the few the server imports beyond them, and NIXL (the
#     p2pweights plugin publishes the server's weights through it).
# The payload is one uncompressed tar split into pieces of PIECE_MIB; MANIFEST holds the
# sha256 of the tar and of every piece, checked on the device before anything installs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
RELAY="$ROOT/.relay"
PIECE_MIB=${PIECE_MIB:-57}
DL="$RELAY/download"
STAGE="$RELAY/stage"
mkdir -p "$DL" "$STAGE"

pip_dl() {  # cp312 manylinux wheels for the GPU machine, no dependencies
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DL" "$@"
}

[ -n "$(ls "$DL"/torch-2.14.1-*.whl 2>/dev/null)" ] || pip_dl torch==2.14.1
[ -n "$(ls "$DL"/sglang_kernel-0.4.10-*.whl 2>/dev/null)" ] || pip_dl sglang-kernel==0.4.10
[ -n "$(ls "$DL"/nvidia_nccl_cu13-2.30.7-*.whl 2>/dev/null)" ] || pip_dl nvidia-nccl-cu13==2.30.7
# sglang's own weight publication (--remote-instance-weight-loader-start-seed-via-transfer-engine)
# and p2pweights' MooncakeConfig: the CUDA 13 build, which registers GPU memory
[ -n "$(ls "$DL"/mooncake_transfer_engine_cuda13-0.3.14-*.whl 2>/dev/null)" ] \
  || pip_dl mooncake-transfer-engine-cuda13==0.3.14
# sglang 0.5.23 builds every Qwen2/Qwen3 MLP with a DualGemm that imports CuTe DSL on CUDA
# (sglang/kernels/ops/gemm/cutedsl_dual_gemm.py); sglang pins nvidia-cutlass-dsl[cu13]==4.8.0.
# `cutlass/cute` itself ships in libs-core (libs-base requires it); libs-cu12 is not needed
# next to libs-cu13 on the CUDA 13 machine.
CUTLASS=(nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu13)
for name in "${CUTLASS[@]}"; do
  norm=$(echo "$name" | tr '-' '_')
  [ -n "$(ls "$DL"/${norm}-4.8.0-*.whl 2>/dev/null)" ] || pip_dl "$name==4.8.0"
done
# What the CPU server imports beyond the benchmark wheel set (scripts/real-sglang.sh installs
# the same on this machine), pinned to the versions in .venv.
server_extras=(xgrammar interegular setproctitle blobfile pycryptodomex zstandard soundfile cffi
  pycparser jsonschema jsonschema-specifications referencing rpds-py torchvision nixl nixl-cu13
  pytest pluggy iniconfig)
for name in "${server_extras[@]}"; do
  ver=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$ver" ] || { echo "pack: $name is not installed in .venv" >&2; exit 1; }
  norm=$(echo "$name" | tr '-' '_')
  [ -n "$(ls "$DL"/${norm}-${ver}-*.whl "$DL"/${name}-${ver}-*.whl 2>/dev/null)" ] || pip_dl "$name==$ver"
done

bash benchmarks/device_wheels.sh >/dev/null

rm -rf "$STAGE" && mkdir -p "$STAGE/wheels"
cp "$DL"/torch-2.14.1-*.whl "$DL"/mooncake_transfer_engine_cuda13-0.3.14-*.whl "$STAGE/wheels/"
# NCCL: by default the machine's own 2.28.9 with a preloaded stub of the 11 calls torch binds
# that it lacks (nccl_shim.c; device.sh sets LD_PRELOAD), four pieces fewer than carrying
# 2.30.7 (CARRY_NCCL=1 carries it instead)
if [ "${CARRY_NCCL:-0}" = 1 ]; then
  cp "$DL"/nvidia_nccl_cu13-2.30.7-*.whl "$STAGE/wheels/"
  rm -f "$RELAY/ncclshim.so"
else
  cc -O2 -shared -fPIC -nostdlib -o "$RELAY/ncclshim.so" scripts/gpu_sglang/nccl_shim.c
fi
for name in "${CUTLASS[@]}"; do
  cp "$DL"/$(echo "$name" | tr '-' '_')-4.8.0-*.whl "$STAGE/wheels/"
done
for name in "${server_extras[@]}"; do
  norm=$(echo "$name" | tr '-' '_')
  cp "$DL"/${norm}-*.whl "$STAGE/wheels/" 2>/dev/null || cp "$DL"/${name}-*.whl "$STAGE/wheels/"
done
cp .whl/*.whl "$STAGE/wheels/"

# The kernel package, slimmed and repacked (a wheel is a zip; pip installs it with --no-deps).
kwork=$(mktemp -d) && trap 'rm -rf "$kwork"' EXIT
(cd "$kwork" && unzip -q "$DL"/sglang_kernel-0.4.10-*.whl \
  && rm -f sgl_kernel/flash_ops.abi3.so && rm -rf sgl_kernel/sm100 \
  && grep -v -e '^sgl_kernel/flash_ops.abi3.so,' -e '^sgl_kernel/sm100/' \
       sglang_kernel-0.4.10.dist-info/RECORD > RECORD.new \
  && mv RECORD.new sglang_kernel-0.4.10.dist-info/RECORD \
  && zip -q -r -X "$STAGE/wheels/$(basename "$DL"/sglang_kernel-0.4.10-*.whl)" .)

# every requirement each wheel declares is met by the payload or by the GPU machine's own
# packages (gpu-machine-packages.txt), so a missing piece shows here, not there
"$PY" scripts/gpu_sglang/check_requirements.py "$STAGE/wheels"
(cd "$STAGE" && sha256sum wheels/*.whl > wheels.sha256)
rm -f "$RELAY"/payload.tar "$RELAY"/piece.* "$RELAY"/MANIFEST
tar -C "$STAGE" -cf "$RELAY/payload.tar" wheels wheels.sha256
(cd "$RELAY" && split -b "${PIECE_MIB}M" -d -a 2 payload.tar piece. \
  && { sha256sum payload.tar; sha256sum piece.*; } > MANIFEST)
n=$(ls "$RELAY"/piece.* | wc -l)
echo "pack: $(du -m "$RELAY/payload.tar" | cut -f1) MiB in $n pieces of up to $PIECE_MIB MiB under .relay/"
cat "$RELAY/MANIFEST"
