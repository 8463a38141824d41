"""Idle CPU of local engines and of a connected trainer, per transport.

For each transport one local engine (TP 2 by default, ``qwen3-tiny``) is started and
left idle; a trainer in this process connects and runs one update, then idles too.
CPU time is read from ``/proc/<pid>/stat`` (user + system, all threads) over
``--seconds`` of idle, for the engine process and for this (trainer) process.
Reported in CPU-seconds per second: 1.00 is one core kept busy.

    .venv/bin/python benchmarks/footprint.py idle-cpu       # both transports, about 1 minute
    .venv/bin/python benchmarks/footprint.py idle-cpu --transports nixl
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from harness import cpu_seconds, machine, markdown_table, write_doc_section
from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig
from p2pweights.local_engine import LocalEngine
from p2pweights.sync_session import WeightSyncSession
from p2pweights.testing import synthetic_weights, write_model_dir

NAME = "idle_cpu"


def idle_rates(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """CPU-seconds per second of each process over the same ``seconds`` of wall time."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    return {name: (cpu_seconds(pid) - before[name]) / wall for name, pid in pids.items()}


def run_case(transport: str, model: str, tp: int, seconds: float) -> dict[str, Any]:
    folder = write_model_dir(model, Path(tempfile.mkdtemp(prefix="p2pweights-idle-")))
    with LocalEngine(folder, tp=tp, transport=transport, seed=0) as engine:
        pid = engine.pid
        if pid is None:
            raise RuntimeError(f"engine {engine.url} has no process")
        time.sleep(2.0)  # let start-up work (imports, arena) settle
        engine_alone = idle_rates({"engine": pid}, seconds)["engine"]
        config = SyncConfig(
            transport=MooncakeConfig(protocol="tcp") if transport == "mooncake" else NixlConfig(),
            buffer_bytes="64MiB",
        )
        with WeightSyncSession(config) as session:
            session.connect([engine.url])
            report = session.update(list(synthetic_weights(folder, seed=1, dtype=torch.bfloat16)))
            time.sleep(1.0)
            both = idle_rates({"engine": pid, "trainer": os.getpid()}, seconds)
    return {
        "transport": transport,
        "model": model,
        "tp": tp,
        "seconds": seconds,
        "update_s": report.seconds,
        "engine_idle_before_connect": engine_alone,
        "engine_idle_connected": both["engine"],
        "trainer_idle_connected": both["trainer"],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transports", nargs="+", default=["mooncake", "nixl"])
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--no-doc", action="store_true", help="do not touch docs/benchmarks-archive.md"
    )


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    meta_before = machine()
    results = [run_case(t, args.model, args.tp, args.seconds) for t in args.transports]
    meta = {"before": meta_before, "after": machine()}
    rows = [
        (
            r["transport"],
            r["tp"],
            r["engine_idle_before_connect"],
            r["engine_idle_connected"],
            r["trainer_idle_connected"],
        )
        for r in results
    ]
    table = markdown_table(
        [
            "transport",
            "engine TP",
            "engine idle, no trainer (CPU-s/s)",
            "engine idle, trainer connected",
            "trainer idle, connected",
        ],
        rows,
    )
    text = (
        f"Command: `{args.command}`; {args.model}, one local engine of TP "
        f"{args.tp}, {args.seconds:g} s per reading; load average "
        f"{meta_before['loadavg_1_5_15']} before, {meta['after']['loadavg_1_5_15']} after "
        f"({meta_before['time']}).\n\n{table}"
    )
    print(text)
    if not args.no_doc:
        write_doc_section(NAME, text)
    return {"meta": meta, "results": results}
