"""Cost of one replica at full size: time and peak RSS to build it and probe its loaders.

Each case runs in a fresh subprocess so RSS is its own. The baseline is the
process RSS once torch and the sglang model module are imported and the HF
checkpoint names and shapes (the trainer's inputs, meta only) are listed; the
peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` after the baseline)
then covers building the replica on meta, bringing it to the reload layout (module
by module; an fp8 engine's attention modules get scalar storage for their k/v-scale
check) and probing every HF name the way a session's first update does (for an fp8
engine: once to choose which names to quantize, once for the groups of the
quantized checkpoint names). No weight is ever materialized.

    .venv/bin/python benchmarks/replica.py build [--doc docs/benchmarks-replica.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# sglang refuses fp8 DeepSeek-V3 / Kimi-K2 at plain TP 64 / TP 32: the per-rank slices
# of the dense MLP (18432 / 64 = 288) and of the shared expert (2048 / 64 = 32) are not
# multiples of the 128 block. Those layouts are served with DP attention, an unsharded
# dense MLP and the shared expert fused into the MoE layer (sglang's default on GPUs;
# forced here, where this CPU host would not choose it), as below.
WIDE = {"enable_dp_attention": True, "moe_dense_tp_size": 1, "enforce_shared_experts_fusion": True}
CASES = [
    ("qwen3-235b-a22b-full", {"tp_size": 32, "ep_size": 32}, "Qwen3-235B-A22B"),
    ("glm-4.5-air-full", {"tp_size": 8, "ep_size": 8}, "GLM-4.5-Air"),
    ("deepseek-v3-full", {"tp_size": 8, "ep_size": 8}, "DeepSeek-V3 671B"),
    ("deepseek-v3-full", {"tp_size": 64, "ep_size": 64, "dp_size": 8, **WIDE}, "DeepSeek-V3 671B"),
    ("deepseek-v3-full", {"tp_size": 64, "ep_size": 64, "bf16": True}, "DeepSeek-V3 671B"),
    ("kimi-k2-full", {"tp_size": 32, "ep_size": 32, "dp_size": 4, **WIDE}, "Kimi-K2 1T"),
]
GIB = 1 << 30


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def run_case(model: str, info: dict[str, int], engine_rank: int) -> dict[str, float | int | str]:
    """One case, in this process; returns the measurements."""
    import importlib

    import torch

    from p2pweights.replica.registry import replica_for
    from p2pweights.source.inputs import InputSpec
    from p2pweights.source.synthetic import hf_checkpoint_names_and_shapes
    from p2pweights.testing import model_config, write_model_dir

    config = model_config(model)
    info = dict(info)
    if info.pop("bf16", False):  # the same model as a bf16 engine
        config.pop("quantization_config", None)
    quantization = config.get("quantization_config")
    from sglang.srt.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls(config["architectures"])
    importlib.import_module(cls.__module__)
    started = time.perf_counter()
    names = hf_checkpoint_names_and_shapes(config)
    names_s = time.perf_counter() - started
    inputs = {name: InputSpec(tuple(shape), dtype) for name, shape, dtype in names}
    folder = write_model_dir(config, Path(tempfile.mkdtemp()) / model)
    del names
    import gc

    gc.collect()
    baseline = _rss_bytes("VmRSS")
    _reset_peak()
    handle = replica_for({"model_path": str(folder), **info}, engine_rank)
    started = time.perf_counter()
    replica = handle.replica
    built_s = time.perf_counter() - started
    fmt = handle.checkpoint_format(inputs)
    groups = handle.groups(fmt.engine_specs(inputs))
    probed_s = time.perf_counter() - started - built_s
    peak = _rss_bytes("VmHWM")
    largest_name, largest_bytes = "", 0
    for name, module in replica.model.named_modules():
        own = sum(
            replica.layouts[f"{name}.{p}" if name else p].num_bytes
            for p, _ in module.named_parameters(recurse=False)
        )
        if own > largest_bytes:
            largest_name, largest_bytes = name, own
    del torch
    return {
        "model": model,
        "dtype": (f"fp8 block {quantization['weight_block_size']}" if quantization else "bf16"),
        "quantized_names": len(getattr(fmt, "names", ())),
        "materialized_modules": len(replica.materialized_modules),
        "layout": _layout(info),
        "rank": engine_rank,
        "hf_names": len(inputs),
        "groups": len(groups),
        "names_s": names_s,
        "build_s": built_s,
        "probe_s": probed_s,
        "baseline_bytes": baseline,
        "added_peak_bytes": peak - baseline,
        "rank_bytes": replica.total_bytes,
        "largest_module": largest_name,
        "largest_module_bytes": largest_bytes,
    }


def _layout(info: dict) -> str:
    text = f"TP {info['tp_size']} / EP {info['ep_size']}"
    if info.get("enable_dp_attention"):
        text += f", DP attention {info['dp_size']}"
    if info.get("moe_dense_tp_size"):
        text += f", dense TP {info['moe_dense_tp_size']}"
    if info.get("enforce_shared_experts_fusion"):
        text += ", shared expert fused"
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--doc", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--rank", type=int, default=1, help="engine rank to build (default 1)")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.case is not None:  # a child: one case in a fresh process
        model, info = json.loads(args.case)
        print(json.dumps(run_case(model, info, args.rank)))
        return None
    rows = []
    for model, info, label in CASES:
        case = json.dumps([model, info])
        proc = subprocess.run(
            [*args.entry, "--case", case, "--rank", str(args.rank)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"case {label} {info} failed")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["label"] = label
        rows.append(result)
        print(_row(result), flush=True)
    table = _table(rows)
    print(table)
    if args.doc is not None:
        args.doc.parent.mkdir(parents=True, exist_ok=True)
        args.doc.write_text(_document(table, args.rank))
    return {"rank": args.rank, "rows": rows}


HEADER = (
    "| model | layout | engine dtype | HF names | groups | build s | probe s | total s "
    "| added peak RSS | largest module (bytes) | target RSS | ok |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(r: dict) -> str:
    total = r["build_s"] + r["probe_s"]
    target = GIB + r["largest_module_bytes"]
    ok = total < 30 and r["added_peak_bytes"] < target
    return (
        f"| {r['label']} | {r['layout']} | {r['dtype']} | {r['hf_names']} | {r['groups']} "
        f"| {r['build_s']:.1f} "
        f"| {r['probe_s']:.1f} | {total:.1f} | {r['added_peak_bytes'] / GIB:.2f} GiB "
        f"| {r['largest_module']} ({r['largest_module_bytes'] / GIB:.2f} GiB) "
        f"| {target / GIB:.2f} GiB | {'yes' if ok else 'NO'} |"
    )


def _table(rows: list[dict]) -> str:
    return "\n".join([HEADER, *(_row(r) for r in rows)])


def _document(table: str, rank: int) -> str:
    return f"""# Replica cost at full size

Time and peak RSS to build one engine rank's replica (rank {rank}) on the meta device,
bring it to the reload layout and probe its loaders for every HF checkpoint name
(meta placeholders, no weights), on the 2-core, 24 GiB CPU machine. "added peak
RSS" is the process's peak RSS during build + probe above its RSS once torch and
the sglang model module are imported; the target is under 30 s and under 1 GiB
plus the rank's largest single module.

Command: `.venv/bin/python benchmarks/replica.py build --doc docs/benchmarks-replica.md`

{table}

Measured {time.strftime("%Y-%m-%d")}; 1-minute load average when written {os.getloadavg()[0]:.1f}.

{NOTES}
"""


NOTES = """\
Notes:
- "HF names" are the trainer's checkpoint names (per-expert
  `mlp.experts.E.gate_proj.weight`, ..., the MTP layer where the checkpoint has one),
  listed from the config on meta, in bf16. For an fp8 engine, "probe s" covers both
  probes of a first update: one that finds which names the engine holds in fp8
  (every matrix probed as fp8), one for the groups of the quantized checkpoint names
  (weights plus `_scale_inv`), hence more groups than the bf16 engine of the same model.
- fp8 engines reach the reload layout module by module: every fp8 linear and MoE
  step runs on meta; the attention modules, whose k/v-scale check reads values, get
  a few bytes of real storage one at a time (122 modules for DeepSeek-V3, about
  0.09 GiB of added peak RSS in all, far under one module's bytes).
- sglang refuses fp8 DeepSeek-V3 at plain TP 64 and Kimi-K2 at plain TP 32: the
  per-rank slices of the dense MLP (18432 / 64 = 288) and of the shared expert
  (2048 / 64 = 32) are not multiples of the 128 block. Those engines are served with
  DP attention, an unsharded dense MLP and the shared expert fused into the MoE layer
  (sglang's default on GPUs; forced with `enforce_shared_experts_fusion` here, where
  the CPU host would not choose it); the bf16 engine of DeepSeek-V3 is also measured
  at plain TP 64 / EP 64.
- Probe before/after (session 1): probing name by name (one `load_weights` call per
  HF name) cost 92 ms per name on GLM-4.5-Air TP 8 / EP 8, about 1,690 s for its
  18,329 names; one provenance-tracked `load_weights` call over all names took 5.3 s.
  The batch probe is also what makes DeepSeek's fused `q_a_proj` +
  `kv_a_proj_with_mqa` loader work (it writes only once both arrive).
"""
