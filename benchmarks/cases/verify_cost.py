"""What verified writes cost: the same updates with ``SyncConfig.verify_writes`` on and off.

Two local engines of one model (TP 1 by default), each with its own session: the
verifying session ("always") writes an engine that digests its weights before every
``end_weight_update`` (``P2PWEIGHTS_WRITE_DIGESTS=1``), the other ("off") an engine that
does not, so each side pays exactly what it would alone. After warm-up updates (the
first probes; with loader replay the second confirms the recording) the two sessions
alternate update by update, and the order flips every repeat (on-off, off-on, ...):
whichever runs second in a pair no longer gains from the first's warm caches, and a
slower minute of a shared machine hits both alike. Reported per mode: the median
update and pause, and for the verifying session its three parts: ``digest`` (this
process digesting each staged slot, or each direct load's target, while the writes
run), ``engine_digest`` (the engine rank digesting its published weights inside its
pause) and ``verify_writes`` (reading every rank's record and comparing). The cost is
the difference of the medians, as a fraction of the unverified update.

On the CPU the engines take Mooncake (TCP loopback) writes from pinned host memory;
with ``--device cuda`` the trainer's tensors sit on ``cuda:0`` and both engines run on
that GPU (colocated: the local engine stands in for sglang, whose CUDA stack does not
run on the lent GPU machine) and take CUDA IPC, loaded directly (``--no-direct``:
staged on the GPU and written)::

    .venv/bin/python benchmarks/verify.py cost                       # qwen3-1g, CPU
    python3 benchmarks/verify.py cost --device cuda \
        --models qwen3-1g:staged:1GiB qwen3-4b-shape:direct:2GiB
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from harness import (
    GB,
    hf_tensors,
    machine,
    markdown_table,
    median,
    named_config,
    write_doc_section,
)
from p2pweights.config import CudaIpcConfig, MooncakeConfig, NixlConfig, SyncConfig
from p2pweights.local_engine import LocalEngine
from p2pweights.session import WeightSyncSession
from p2pweights.testing import save_safetensors

NAME = "verify_cost"
PARTS = ("digest", "engine_digest", "verify_writes")
MODES = {"on": "always", "off": "off"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        nargs="+",
        default=["qwen3-1g"],
        help="model[:staged|direct[:BUFFER]] each, measured one after the other in this run "
        "(GPU: staged or loaded directly, and the staging buffer, per model)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--buffer", default="256MiB")
    parser.add_argument("--no-direct", action="store_true", help="GPU: stage, then write")
    parser.add_argument("--quick", action="store_true", help="qwen3-demo, 2 repeats")
    parser.add_argument("--no-doc", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("verify cost --device cuda: this host has no CUDA device")
    if args.quick:
        args.models, args.repeats = ["qwen3-demo"], 2
    logging.basicConfig(level=logging.WARNING)
    command = args.command
    before, started = machine(), time.perf_counter()
    results = {spec: measure(*_spec(spec, args)) for spec in args.models}
    result: dict[str, Any] = {
        "meta": {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "tp": args.tp,
            "repeats": args.repeats,
            "machine_before": before,
            "machine_after": machine(),
            "wall_s": time.perf_counter() - started,
            "command": command,
        },
        "models": results,
    }
    text = describe(result, args)
    if not args.no_doc and args.device == "cpu":
        write_doc_section(NAME, text)
    print(text)
    return result


def _spec(spec: str, args: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """``model[:staged|direct[:BUFFER]]`` -> the model and this run's arguments for it."""
    model, *rest = spec.split(":")
    own = argparse.Namespace(**vars(args))
    if rest:
        if rest[0] not in ("staged", "direct"):
            raise SystemExit(f"verify cost: {spec!r}: say staged or direct after the model")
        own.no_direct = rest[0] == "staged"
    if len(rest) > 1:
        own.buffer = rest[1]
    return model, own


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    gpu = args.device == "cuda"
    config = named_config(model)
    folder = Path(tempfile.mkdtemp(prefix="p2pweights-verify-"))
    (folder / "config.json").write_text(__import__("json").dumps(config))
    tensors = hf_tensors(config)
    if gpu:
        tensors = [(name, t.to("cuda:0")) for name, t in tensors]
    else:
        save_safetensors(folder, tensors)
    if gpu:
        transport: Any = CudaIpcConfig(device=0, direct=not args.no_direct)
        engine_transport, device = "cuda_ipc", "cuda:0"
    elif args.transport == "mooncake":
        transport, engine_transport, device = MooncakeConfig(protocol="tcp"), "mooncake", "cpu"
    else:
        transport, engine_transport, device = NixlConfig(), "nixl", "cpu"
    engines = {
        mode: LocalEngine(
            folder / "config.json",
            tp=args.tp,
            transport=engine_transport,
            device=device,
            weights=None if gpu else folder,
            startup_timeout_s=900,
            env={"P2PWEIGHTS_WRITE_DIGESTS": "1" if mode == "on" else "0"},
        )
        for mode in MODES
    }
    reports: dict[str, list[Any]] = {mode: [] for mode in MODES}
    sessions: dict[str, WeightSyncSession] = {}
    try:
        for engine in engines.values():
            engine.start()  # both start at once
        for engine in engines.values():
            engine.wait_ready()
        for mode, verify in MODES.items():
            sync = SyncConfig(transport=transport, buffer_bytes=args.buffer, verify_writes=verify)
            session = WeightSyncSession(sync, staging_device="cuda:0" if gpu else None)
            sessions[mode] = session
            session.connect([engines[mode].url])
        for warm in range(2):
            for session in sessions.values():
                session.update(tensors, version=f"warm-{warm}")
        for repeat in range(args.repeats):
            order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
            for mode in order:
                if gpu:
                    torch.cuda.synchronize()
                reports[mode].append(sessions[mode].update(tensors, version=str(repeat + 1)))
    finally:
        for session in sessions.values():
            session.close()
        for engine in engines.values():
            engine.stop()
        shutil.rmtree(folder, ignore_errors=True)
    seconds = {mode: median([r.seconds for r in rs]) for mode, rs in reports.items()}
    paused = {
        mode: median([max(r.paused_s.values(), default=0.0) for r in rs])
        for mode, rs in reports.items()
    }
    parts = {p: median([r.stage_seconds.get(p, 0.0) for r in reports["on"]]) for p in PARTS}
    return {
        "path": (
            f"{'staged' if args.no_direct else 'loaded directly'}, buffer {args.buffer}"
            if gpu
            else f"buffer {args.buffer}"
        ),
        "bytes_written": reports["on"][0].bytes_written,
        "median_update_s": seconds,
        "median_paused_s": paused,
        "median_parts_s": parts,
        "cost_fraction": seconds["on"] / seconds["off"] - 1,
        "pause_cost_fraction": paused["on"] / paused["off"] - 1,
        "updates": {
            mode: [
                {"seconds": r.seconds, "paused_s": r.paused_s, "stages": r.stage_seconds}
                for r in rs
            ]
            for mode, rs in reports.items()
        },
    }


def describe(result: dict[str, Any], args: argparse.Namespace) -> str:
    meta = result["meta"]
    where = (
        f"one {meta['device']}, both engines colocated on it, CUDA IPC"
        if args.device == "cuda"
        else f"this CPU, {args.transport} over loopback"
    )
    rows = []
    for model, r in result["models"].items():
        s, p = r["median_update_s"], r["median_paused_s"]
        rows.append(
            [
                f"{model} ({r['bytes_written'] / GB:.2f} GB, {r['path']})",
                f"{s['off'] * 1e3:.1f}",
                f"{s['on'] * 1e3:.1f}",
                f"{r['cost_fraction'] * 100:+.1f} %",
                f"{p['off'] * 1e3:.1f} / {p['on'] * 1e3:.1f}",
                " / ".join(f"{v * 1e3:.1f}" for v in r["median_parts_s"].values()),
            ]
        )
    return (
        f"Command: `{meta['command']}`; {where}; local engines of TP {meta['tp']}, one per "
        f"session (only the verified one digests); medians of {meta['repeats']} updates per "
        f"mode after two warm-ups, the sessions alternating with the order flipped every "
        f"repeat; load average {meta['machine_before']['loadavg_1_5_15']} before "
        f"({meta['machine_before']['time']}).\n\n"
        + markdown_table(
            [
                "model",
                "update ms, off",
                "update ms, verified",
                "cost",
                "paused ms off / verified",
                "digest / engine_digest / verify_writes ms",
            ],
            rows,
        )
    )
