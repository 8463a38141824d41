"""CPU time of sglang's loaders per HF tensor, for the plan's predicted time.

One replica per case loads every HF tensor of a tiny model (kilobytes each) into CPU
views with ``load_into``, as the staging step does; the model is built twice, with few
and with many layers, and the difference in time over the difference in tensors is the
cost per HF tensor (name mapping, narrow, copy launch), free of per-call constants.
Minimum of the repeats (the machine is shared; the minimum is the least disturbed).

    .venv/bin/python benchmarks/replica.py loader     # results/loader_overhead.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import measure

CASES = [("qwen3-tiny", 2, 1), ("qwen3-moe-tiny", 2, 2), ("deepseek-v3-tiny", 2, 2)]
LAYERS = (2, 12)


def _load_time(model: str, tp: int, ep: int, layers: int, repeats: int) -> tuple[int, int, float]:
    import torch

    from p2pweights.replica.registry import replica_for
    from p2pweights.source.inputs import describe_inputs
    from p2pweights.testing import model_config, synthetic_weights, write_model_dir

    config = model_config(model)
    config["num_hidden_layers"] = layers
    config.pop("num_nextn_predict_layers", None)
    folder = write_model_dir(config, Path(tempfile.mkdtemp()) / model)
    handle = replica_for({"model_path": str(folder), "tp_size": tp, "ep_size": ep}, 0)
    weights = list(synthetic_weights(folder, seed=1, dtype=torch.bfloat16))
    specs = describe_inputs(weights)
    groups = handle.groups(handle.checkpoint_format(specs).engine_specs(specs))
    fed = {name for group in groups for name in group.hf_names}
    inputs = [(name, tensor) for name, tensor in weights if name in fed]
    views = {
        name: torch.empty(layout.num_bytes, dtype=torch.uint8)
        for name, layout in handle.layouts.items()
    }
    timing = measure(lambda: handle.load_into(inputs, views), repeats, warmup=0)
    return len(inputs), sum(v.numel() for v in views.values()), timing.min


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=15, help="the minimum is taken")


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for model, tp, ep in CASES:
        (few, few_bytes, few_s), (many, many_bytes, many_s) = (
            _load_time(model, tp, ep, layers, args.repeats) for layers in LAYERS
        )
        per_tensor = (many_s - few_s) / (many - few)
        rows.append(
            {
                "model": model,
                "tp": tp,
                "ep": ep,
                "layers": list(LAYERS),
                "hf_tensors": [few, many],
                "bytes": [few_bytes, many_bytes],
                "min_s": [few_s, many_s],
                "per_tensor_s": per_tensor,
            }
        )
        print(f"{model} TP {tp} EP {ep}: {per_tensor * 1e6:.0f} us per HF tensor", flush=True)
    result = {
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()}",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cases": rows,
        "median_per_tensor_s": sorted(r["per_tensor_s"] for r in rows)[len(rows) // 2],
    }
    print(f"median {result['median_per_tensor_s'] * 1e6:.0f} us per HF tensor")
    return result
