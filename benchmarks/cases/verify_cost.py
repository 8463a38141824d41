"""What verified writes cost: the same updates with ``SyncConfig.verify_writes`` on and off.

Local engines of one model (TP 1 by default), each with its own session. Each verifying
session ("always") writes an engine that digests its weights
(``P2PWEIGHTS_WRITE_DIGESTS=1``): "on" every parameter right before each
``end_weight_update``, "as-written" each parameter once its writes landed
(``SyncConfig.digest_as_written``: only the last flush's are left for the end); the
"off" session writes an engine that does not digest, so each side pays exactly what it
would alone. After warm-up updates (the first probes; with loader replay the second
confirms the recording) the sessions take turns update by update, and the order
rotates every repeat (on, off, as-written; off, as-written, on; ...): none always runs
after another's warm caches, and a slower minute of a shared machine hits all alike.
Reported per mode: the median update and pause, and for each verifying session its
three parts: ``digest`` (this process digesting each staged slot, or each direct
load's target, while the writes run), ``engine_digest`` (the engine rank's digesting
inside its end) and ``verify_writes`` (reading every rank's record and comparing). The
cost is the difference of the medians, as a fraction of the unverified update.

On the CPU the engines take Mooncake (TCP loopback) writes from pinned host memory;
with ``--device cuda`` the trainer's tensors sit on ``cuda:0`` and both engines run on
that GPU (colocated: the local engine stands in for sglang, whose CUDA stack does not
run on the lent GPU machine) and take CUDA IPC, loaded directly (``--no-direct``:
staged on the GPU and written)::

    .venv/bin/python benchmarks/verify.py cost                       # qwen3-1g, CPU
    python3 benchmarks/verify.py cost --device cuda \
        --models qwen3-1g:staged:1GiB qwen3-4b-shape:direct:2GiB     # all three modes
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
from p2pweights.sync_session import WeightSyncSession
from p2pweights.testing import save_safetensors

NAME = "verify_cost"
PARTS = ("digest", "engine_digest", "verify_writes")
MODES = {"on": ("always", False), "off": ("off", False), "as-written": ("always", True)}
"""Mode -> (``verify_writes``, ``digest_as_written``): "on" digests every parameter at the
engine's end, "as-written" each one as its writes land (only the last flush's at the end)."""


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
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="on: digests at the end; as-written: as each parameter's writes land; off: none",
    )


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
    modes = list(dict.fromkeys(["off", *args.modes]))  # the baseline, always
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
            env={"P2PWEIGHTS_WRITE_DIGESTS": "0" if mode == "off" else "1"},
        )
        for mode in modes
    }
    reports: dict[str, list[Any]] = {mode: [] for mode in modes}
    sessions: dict[str, WeightSyncSession] = {}
    try:
        for engine in engines.values():
            engine.start()  # both start at once
        for engine in engines.values():
            engine.wait_ready()
        for mode in modes:
            verify, as_written = MODES[mode]
            sync = SyncConfig(
                transport=transport,
                buffer_bytes=args.buffer,
                verify_writes=verify,
                digest_as_written=as_written,
            )
            session = WeightSyncSession(sync, staging_device="cuda:0" if gpu else None)
            sessions[mode] = session
            session.connect([engines[mode].url])
        for warm in range(2):
            for session in sessions.values():
                session.update(tensors, version=f"warm-{warm}")
        for repeat in range(args.repeats):
            # each mode in each place of the order in turn (two modes: on-off, off-on)
            order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]
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
    path = f"buffer {args.buffer}"
    if gpu:
        path = f"{'staged' if args.no_direct else 'loaded directly'}, {path}"
    return {"path": path, **compared(reports, PARTS)}


def compared(reports: dict[str, list[Any]], parts: tuple[str, ...]) -> dict[str, Any]:
    """Medians of the update reports of each mode, and each checked mode's cost against
    ``"off"``'s (the update's and the pause's, as fractions), with every update kept."""
    seconds = {mode: median([r.seconds for r in rs]) for mode, rs in reports.items()}
    paused = {
        mode: median([max(r.paused_s.values(), default=0.0) for r in rs])
        for mode, rs in reports.items()
    }
    checked = [mode for mode in reports if mode != "off"]
    return {
        "bytes_written": reports["off"][0].bytes_written,
        "median_update_s": seconds,
        "median_paused_s": paused,
        "median_parts_s": {
            mode: {p: median([r.stage_seconds.get(p, 0.0) for r in reports[mode]]) for p in parts}
            for mode in checked
        },
        "cost_fraction": {mode: seconds[mode] / seconds["off"] - 1 for mode in checked},
        "pause_cost_fraction": {mode: paused[mode] / paused["off"] - 1 for mode in checked},
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
        for mode, cost in r["cost_fraction"].items():
            rows.append(
                [
                    f"{model} ({r['bytes_written'] / GB:.2f} GB, {r['path']})",
                    mode,
                    f"{s['off'] * 1e3:.1f}",
                    f"{s[mode] * 1e3:.1f}",
                    f"{cost * 100:+.1f} %",
                    f"{p['off'] * 1e3:.1f} / {p[mode] * 1e3:.1f}",
                    " / ".join(f"{v * 1e3:.1f}" for v in r["median_parts_s"][mode].values()),
                ]
            )
    return (
        f"Command: `{meta['command']}`; {where}; local engines of TP {meta['tp']}, one per "
        f"session (only the verified ones digest: 'on' at the engine's end, 'as-written' "
        f"as each parameter's writes land, SyncConfig.digest_as_written); medians of "
        f"{meta['repeats']} updates per mode after two warm-ups, the sessions taking turns "
        f"with the order rotated every repeat; load average "
        f"{meta['machine_before']['loadavg_1_5_15']} before "
        f"({meta['machine_before']['time']}).\n\n"
        + markdown_table(
            [
                "model",
                "verified",
                "update ms, off",
                "update ms, verified",
                "cost",
                "paused ms off / verified",
                "digest / engine_digest / verify_writes ms",
            ],
            rows,
        )
    )
