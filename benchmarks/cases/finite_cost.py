"""What the NaN / Inf input check costs (``SyncConfig.verify_finite_inputs``).

The check alone over a model's bf16 tensors (one pass, as ``update()`` runs it), then
updates of one local engine (Mooncake over TCP loopback) with the check off and on. A
session's config is fixed, so the sessions alternate, round by round in turns (off, on;
on, off; ...); the first update of each session probes and is left out. The check runs
before the engines pause, so it adds to the update, not to the pause::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/verify.py finite --model qwen3-demo --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from harness import GB, hf_tensors, named_config
from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
from p2pweights.local_engine import LocalEngine
from p2pweights.source.finite import check_finite


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-demo")
    parser.add_argument("--rounds", type=int, default=3, help="sessions per mode")
    parser.add_argument("--updates", type=int, default=4, help="per session; the first probes")


def check_alone(tensors: list[tuple[str, torch.Tensor]], repeats: int = 5) -> float:
    """The median seconds of one pass of the check over ``tensors``."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for name, tensor in tensors:
            check_finite(name, tensor)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = named_config(args.model)
    tensors = hf_tensors(config)
    num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    check_s = check_alone(tensors)
    print(f"{args.model}: {num_bytes / 1e6:.1f} MB, check alone {check_s * 1e3:.1f} ms")
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        (folder / "config.json").write_text(json.dumps(config))
        with LocalEngine(folder, tp=1, seed=0, startup_timeout_s=900) as engine:
            for round_ in range(args.rounds):
                for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                    sync = SyncConfig(
                        transport=MooncakeConfig(protocol="tcp"),
                        verify_finite_inputs=mode == "on",
                        buffer_bytes="256MiB",
                    )
                    with WeightSyncSession(sync) as session:
                        session.connect([engine.url])
                        for index in range(args.updates):
                            report = session.update(tensors)
                            if index:  # the first probes
                                rows[mode].append(
                                    {
                                        "update_s": report.seconds,
                                        "check_inputs_s": report.stage_seconds.get(
                                            "check_inputs", 0.0
                                        ),
                                        "paused_s": max(report.paused_s.values()),
                                    }
                                )

    def med(mode: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows[mode]), 4)

    on, off = med("on", "update_s"), med("off", "update_s")
    result = {
        "model": args.model,
        "bytes": num_bytes,
        "torch_threads": torch.get_num_threads(),
        "check_alone_s": round(check_s, 4),
        "check_gb_per_s": round(num_bytes / check_s / GB, 2),
        "medians": {
            mode: {key: med(mode, key) for key in ("update_s", "check_inputs_s", "paused_s")}
            for mode in rows
        },
        "update_ratio_on_off": round(on / off, 3),
        "raw": rows,
    }
    print(f"update off {off:.3f} s, on {on:.3f} s: x{on / off:.3f}")
    return result
