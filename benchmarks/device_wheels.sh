#!/usr/bin/env bash
# Fill .whl/ with the wheels a lent GPU machine needs to import sglang's model
# code and run p2pweights there (x86-64, CPython 3.12, no network).
#
# That machine already has: torch, triton, numpy, safetensors, huggingface_hub,
# tokenizers, transformers 5.17, requests, httpx, httpcore, h11, anyio, idna,
# certifi, psutil, pyyaml, tqdm, filelock, fsspec, packaging, jinja2, msgpack,
# aiohttp, uvloop, einops, sentencepiece, tiktoken, regex, pillow, protobuf,
# rich, typer, click, cuda-bindings, cupy, prometheus-client, pyarrow, pandas,
# scipy.  Those are not carried.
#
# Everything carried is pinned to the version installed in .venv:
#   * sglang is repacked from .venv's site-packages into a pure
#     sglang-<ver>-py3-none-any.whl (pip cannot download that version), without
#     its cp311 Rust extensions, multimodal_gen, test, benchmark and __pycache__;
#   * the rest is downloaded from the index as cp312 / manylinux x86-64 wheels.
#
# Usage:  benchmarks/device_wheels.sh        (run from anywhere; idempotent)
# On the device:
#   pip install --no-index --no-deps --target SOMEDIR .whl/*.whl
#   export PYTHONPATH=SOMEDIR:$PWD/src
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
OUT="$ROOT/.whl"
LIMIT_MIB=40

# Distributions carried, by name as installed in .venv (versions come from it).
PACKAGES=(
  # transformers: the machine's 5.17 is older than sglang 0.5.23's pin (5.19)
  transformers
  # pydantic stack (p2pweights config, sglang, fastapi, openai)
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  # imported by sglang at import time
  orjson pybase64 msgspec pyzmq apache-tvm-ffi
  starlette sniffio python-multipart
  dill compressed-tensors loguru gguf
  openai distro jiter partial-json-parser
  # huggingface_hub 2.x in .venv uses these (the machine's 1.33 may not)
  httpx2 httpcore2 truststore
  # sglang/utils.py does `from IPython.display import HTML, display` at import;
  # that loads only IPython and traitlets (pygments is on the machine).  The rest
  # are ipython's declared deps, small, kept for a shell's sake -- except jedi
  # (4.7 MiB) and parso (its only user): completion only, never imported on
  # sglang's import path, and they would push .whl/ over 40 MiB.
  ipython traitlets ipython-pygments-lexers prompt-toolkit wcwidth pexpect
  ptyprocess matplotlib-inline stack-data asttokens executing pure-eval
  # p2pweights' local engine server and sglang plugin bootstrap
  fastapi annotated-doc opentelemetry-api uvicorn
)

[ -x "$PY" ] || { echo "no virtualenv at $ROOT/.venv" >&2; exit 1; }

rm -rf "$OUT"
mkdir -p "$OUT"

# name==version for each, as installed in .venv
mapfile -t SPECS < <("$PY" - "${PACKAGES[@]}" <<'EOF'
import sys, importlib.metadata as md
bad = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        bad.append(name)
if bad:
    sys.exit(f"not installed in .venv: {' '.join(bad)}")
EOF
)

echo "== downloading ${#SPECS[@]} wheels (cp312, manylinux x86-64)"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$OUT" "${SPECS[@]}"

echo "== repacking sglang from .venv"
"$PY" - "$OUT" <<'EOF'
import base64, csv, fnmatch, hashlib, importlib.metadata as md, io, os, sys, zipfile
from pathlib import Path

out = Path(sys.argv[1])
dist = md.distribution("sglang")
ver = dist.version
site = Path(dist.locate_file(""))          # site-packages
pkg = site / "sglang"
info = Path(dist._path)                     # sglang-<ver>.dist-info
assert pkg.is_dir() and info.is_dir(), (pkg, info)

# Left out: cp311 binaries (useless on 3.12), and parts not on the
# model-loading path.  Paths are relative to site-packages, '/' separated.
EXCLUDE_PREFIXES = (
    "sglang/multimodal_gen/",
    "sglang/test/",
    "sglang/benchmark/",
    "sglang/srt/mem_cache/rust_tree_core",
)
EXCLUDE_GLOBS = ("sglang/srt/rust_extensions/_*.so",)
INFO_SKIP = {"RECORD", "WHEEL", "INSTALLER", "REQUESTED", "direct_url.json"}

def excluded(rel: str) -> bool:
    parts = rel.split("/")
    if "__pycache__" in parts or rel.endswith((".pyc", ".pyo")):
        return True
    if rel.startswith(EXCLUDE_PREFIXES):
        return True
    return any(fnmatch.fnmatchcase(rel, g) for g in EXCLUDE_GLOBS)

files = []
for root, dirs, names in os.walk(pkg):
    dirs.sort()
    for n in sorted(names):
        p = Path(root) / n
        rel = p.relative_to(site).as_posix()
        if p.is_file() and not excluded(rel):
            files.append((rel, p))
info_name = f"sglang-{ver}.dist-info"
for p in sorted(info.rglob("*")):
    rel_in = p.relative_to(info).as_posix()
    if p.is_file() and rel_in not in INFO_SKIP:
        files.append((f"{info_name}/{rel_in}", p))

wheel_meta = (
    "Wheel-Version: 1.0\n"
    "Generator: p2pweights benchmarks/device_wheels.sh (repack)\n"
    "Root-Is-Purelib: true\n"
    "Tag: py3-none-any\n"
).encode()

def digest(data: bytes) -> str:
    h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + h.decode()

wheel_path = out / f"sglang-{ver}-py3-none-any.whl"
record = io.StringIO()
writer = csv.writer(record, lineterminator="\n")   # quotes paths with commas

def add(zf, arc, data, mode=0o644):
    zi = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
    zi.compress_type = zipfile.ZIP_DEFLATED
    zi.external_attr = (0o100000 | mode) << 16
    zf.writestr(zi, data)
    writer.writerow([arc, digest(data), str(len(data))])

with zipfile.ZipFile(wheel_path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
    for arc, p in files:
        mode = 0o755 if os.access(p, os.X_OK) and not arc.endswith(".py") else 0o644
        add(zf, arc, p.read_bytes(), mode)
    add(zf, f"{info_name}/WHEEL", wheel_meta)
    rec_arc = f"{info_name}/RECORD"
    writer.writerow([rec_arc, "", ""])
    zi = zipfile.ZipInfo(rec_arc, date_time=(1980, 1, 1, 0, 0, 0))
    zi.compress_type = zipfile.ZIP_DEFLATED
    zi.external_attr = (0o100644) << 16
    zf.writestr(zi, record.getvalue().encode())

# self-check: RECORD parses as CSV and matches the archive
with zipfile.ZipFile(wheel_path) as zf:
    rows = list(csv.reader(io.StringIO(zf.read(f"{info_name}/RECORD").decode())))
    names = set(zf.namelist())
    assert {r[0] for r in rows} == names, "RECORD does not list the archive"
    for path, h, size in rows:
        if h:
            data = zf.read(path)
            assert h == digest(data) and int(size) == len(data), path
print(f"{wheel_path.name}: {len(files) + 2} files, "
      f"{wheel_path.stat().st_size / 2**20:.1f} MiB")
EOF

echo "== check: one wheel per distribution"
"$PY" - "$OUT" <<'EOF'
import collections, sys
from pathlib import Path
seen = collections.Counter(
    p.name.split("-")[0].lower().replace("_", "-").replace(".", "-")
    for p in Path(sys.argv[1]).glob("*.whl"))
dup = [n for n, c in seen.items() if c > 1]
if dup:
    sys.exit(f"more than one wheel for: {dup}")
print(f"{sum(seen.values())} wheels")
EOF

echo "== .whl/"
ls -l --block-size=K "$OUT" | awk 'NR>1 {printf "%8s  %s\n", $5, $9}'
total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
awk -v t="$total" 'BEGIN {printf "total: %d bytes (%.2f MiB)\n", t, t / 1048576}'
if [ "$total" -ge $((LIMIT_MIB * 1048576)) ]; then
  echo "ERROR: .whl/ is over ${LIMIT_MIB} MiB" >&2
  exit 1
fi
