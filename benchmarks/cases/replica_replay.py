"""Host and wall time per HF tensor of a replayed load: op by op, batched, one launch.

A warm update's load stage replays each parameter group's recorded copies
(``replica/sglang/replay.py``). With inputs and destinations on one GPU, a step's copies
run in one Triton launch where there are enough of them (``gathered_copies.py``), else
through ``_foreach_copy_``; mixed devices (GPU inputs into pinned host buffers) and the
CPU run one ``copy_`` per op. This loads every group of one rank's replica, as the
staging step does, the three ways side by side (on the CPU all three are op by op):
"op by op", "foreach" (``P2PWEIGHTS_COPY_KERNEL=0``) and "kernel" (the default); and
reports per HF tensor the host time until the loads returned and the wall time until
the device finished, and whether all ways wrote the same bytes. Inputs are random
values of the engine's checkpoint dtypes (fp8 engines: fp8 weights and float32 scales,
as the quantizer hands them over).

    .venv/bin/python benchmarks/replica.py replay --model qwen3-moe-30b-a3b-7-layers \\
        --layers 2 --tp 4 --device cuda [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from harness import named_config


def _config(name: str, layers: int | None, overrides: dict[str, Any]) -> dict[str, Any]:
    config = {**named_config(name), **overrides}
    if layers is not None:
        config["num_hidden_layers"] = layers
        config.pop("num_nextn_predict_layers", None)
    return config


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(shape, device=device) * 0.02).to(dtype)
    out = torch.empty(shape, dtype=dtype, device=device)
    out.view(torch.uint8).random_(0, 0x70)  # finite fp8 / small integers
    return out


def measure(
    model: str,
    layers: int | None,
    tp: int,
    ep: int,
    device: str,
    repeats: int,
    overrides: dict[str, Any] | None = None,
) -> dict:
    from p2pweights.replica.registry import replica_for
    from p2pweights.replica.sglang.replay import Replay
    from p2pweights.source.inputs import describe_inputs
    from p2pweights.testing import hf_checkpoint_names_and_shapes, write_model_dir

    config = _config(model, layers, overrides or {})
    folder = write_model_dir(config, Path(tempfile.mkdtemp()) / model)
    handle = replica_for({"model_path": str(folder), "tp_size": tp, "ep_size": ep}, 0)
    specs = describe_inputs(
        [
            (name, torch.empty(shape, dtype=torch.bfloat16, device="meta"))
            for name, shape, _ in hf_checkpoint_names_and_shapes(config)
        ]
    )
    engine_specs = handle.checkpoint_format(specs).engine_specs(specs)
    groups = handle.groups(engine_specs)
    fed = sorted({name for group in groups for name in group.hf_names})
    inputs = {n: _random(tuple(engine_specs[n].shape), engine_specs[n].dtype, device) for n in fed}
    views = {
        name: torch.empty(layout.num_bytes, dtype=torch.uint8, device=device)
        for name, layout in handle.layouts.items()
    }
    work = [
        ([(n, inputs[n]) for n in sorted(g.hf_names)], {p: views[p] for p in g.param_names})
        for g in groups
    ]
    num_inputs = sum(len(i) for i, _ in work)
    num_bytes = sum(v.numel() for v in views.values())

    def load() -> None:
        for hf_tensors, destinations in work:
            handle.load_into(hf_tensors, destinations)

    for _ in range(3):  # recorded, confirmed, replayed
        load()
    batched = Replay._run_on_one_gpu
    out: dict[str, Any] = {
        "model": model,
        "overrides": overrides or {},
        "layers": config["num_hidden_layers"],
        "tp": tp,
        "ep": ep,
        "device": device,
        "groups": len(work),
        "hf_tensors": num_inputs,
        "bytes": num_bytes,
        "replayed_loads": handle.replayed_loads if hasattr(handle, "replayed_loads") else None,
    }
    written = {}
    ways = (
        ("op by op", Replay._run_in_order, "1"),
        ("foreach", batched, "0"),
        ("kernel", batched, "1"),
    )
    for way, run, kernel in ways:
        Replay._run_on_one_gpu = run  # type: ignore[method-assign]
        os.environ["P2PWEIGHTS_COPY_KERNEL"] = kernel
        try:
            host, wall = [], []
            for _ in range(repeats):
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                started = time.perf_counter()
                load()
                host.append(time.perf_counter() - started)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                wall.append(time.perf_counter() - started)
        finally:
            Replay._run_on_one_gpu = batched  # type: ignore[method-assign]
        written[way] = {name: v.clone() for name, v in views.items()}
        out[way] = {
            "host_us_per_hf_tensor": statistics.median(host) / num_inputs * 1e6,
            "wall_us_per_hf_tensor": statistics.median(wall) / num_inputs * 1e6,
            "wall_s": statistics.median(wall),
            "gb_per_s": num_bytes / statistics.median(wall) / 1e9,
        }
        print(
            f"{model} x{out['layers']} TP {tp} EP {ep} {device} {way}: "
            f"{out[way]['host_us_per_hf_tensor']:.1f} us host, "
            f"{out[way]['wall_us_per_hf_tensor']:.1f} us wall per HF tensor "
            f"({num_inputs} tensors, {num_bytes / 1e9:.2f} GB, {out[way]['gb_per_s']:.0f} GB/s)",
            flush=True,
        )
    out["same_bytes"] = all(
        torch.equal(written["op by op"][n], written[way][n])
        for way in ("foreach", "kernel")
        for n in views
    )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", nargs="+", default=["qwen3-moe-30b-a3b-7-layers"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tp", nargs="+", type=int, default=[4])
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=JSON",
        help="config overrides, e.g. n_routed_experts=384 (Kimi-K2's expert count)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"replica replay --device {args.device}: this host has no CUDA device")
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    rows = [
        measure(model, args.layers, tp, args.ep, args.device, args.repeats, overrides)
        for model in args.model
        for tp in args.tp
    ]
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__,
        },
        "args": {k: v for k, v in vars(args).items() if k not in ("entry", "command")}
        | {"out": str(args.out)},
        "rows": rows,
    }
    return result
