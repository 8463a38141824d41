"""How long engines stand paused per update: staging before the pause against pausing first.

One local engine (sglang's own model code on the CPU, standing in for a real sglang
server) and two sessions of the same trainer process, one with
``SyncConfig(stage_before_pause=True)`` (the default: inputs read, checked and the
first staging buffer loaded while the engine still generates) and one with ``False``
(the engine pauses before the inputs are read). Their warm updates alternate, so both
see the same machine; each writes the same tensors, as a list and as a stream.
Reported per order: the median ``UpdateReport.seconds``, ``paused_s`` (the engine's
pause returned -> its resume returned), the load stage and the control calls.

    .venv/bin/python benchmarks/update.py pause                  # qwen3-1g, TP 2, 1 GiB buffers
    .venv/bin/python benchmarks/update.py pause --buffer 256MiB  # the first buffer only
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import CONFIGS, hf_tensors, machine, markdown_table, median
from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig
from p2pweights.local_engine import LocalEngine
from p2pweights.report import UpdateReport
from p2pweights.sync_session import WeightSyncSession
from p2pweights.testing import save_safetensors

NAME = "pause_time"
ORDERS = {"staged before pause": True, "paused first": False}


def row(report: UpdateReport) -> dict[str, Any]:
    return {
        "seconds": report.seconds,
        "paused_s": max(report.paused_s.values(), default=0.0),
        "load_s": report.stage_seconds.get("load", 0.0),
        "control_calls": report.num_control_calls,
        "control_call_s": report.control_call_seconds,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(CONFIGS / "qwen3-1g.json"))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--buffer", default="1GiB")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    logging.basicConfig(level=logging.WARNING)
    before, started = machine(), time.perf_counter()
    tensors = hf_tensors(args.model)
    transport = MooncakeConfig(protocol="tcp") if args.transport == "mooncake" else NixlConfig()
    weights = tempfile.mkdtemp(prefix="p2pweights-pause-")
    save_safetensors(weights, tensors)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        order: {"list": [], "stream": []} for order in ORDERS
    }
    with LocalEngine(args.model, tp=args.tp, transport=args.transport, weights=weights) as engine:
        sessions = {
            order: WeightSyncSession(
                SyncConfig(transport=transport, buffer_bytes=args.buffer, stage_before_pause=staged)
            )
            for order, staged in ORDERS.items()
        }
        try:
            for session in sessions.values():
                session.connect([engine.url])
                session.update(tensors)  # probe
                session.update(tensors)  # replay recorded
                session.update(tensors)  # replay confirmed
            for _ in range(args.repeats):
                for order, session in sessions.items():
                    runs[order]["list"].append(row(session.update(tensors)))
                    runs[order]["stream"].append(row(session.update(iter(tensors))))
        finally:
            for session in sessions.values():
                session.close()
    shutil.rmtree(weights, ignore_errors=True)
    summary = {
        order: {
            kind: {key: median([r[key] for r in rows]) for key in rows[0]}
            for kind, rows in kinds.items()
        }
        for order, kinds in runs.items()
    }
    result = {
        "meta": {
            "model": Path(args.model).name,
            "tp": args.tp,
            "transport": args.transport,
            "buffer": args.buffer,
            "repeats": args.repeats,
            "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "machine_before": before,
            "machine_after": machine(),
            "wall_s": time.perf_counter() - started,
            "command": args.command,
        },
        "median": summary,
        "updates": runs,
    }
    table = markdown_table(
        ["order", "input", "update s", "paused s", "load s", "control calls", "their wall s"],
        [
            [
                order,
                kind,
                m["seconds"],
                m["paused_s"],
                m["load_s"],
                m["control_calls"],
                m["control_call_s"],
            ]
            for order, kinds in summary.items()
            for kind, m in kinds.items()
        ],
    )
    print(table)
    return result
