"""Peak trainer memory of a first update: the input read whole against streamed by its specs.

The trainer holds a transformers Qwen3 of ``qwen3-demo``'s shape (28 layers: 1.01 GB of
bf16) as fp32 master weights and sends it with ``hf_named_tensors(model,
dtype=torch.bfloat16)``, which casts bucket by bucket, as a trainer's gather of FSDP2
shards makes new full tensors bucket by bucket. Two modes, each in a fresh process,
into the same local engine (TP 1, Mooncake TCP):

* ``whole``: the pairs as a plain generator, so the first update reads them whole
  (``list``) before planning, as every first update did before;
* ``streamed``: ``hf_named_tensors``' own iterator, whose ``specs()`` says what it will
  yield: the first update plans from that and streams the tensors.

Each trainer's baseline RSS is taken with its model built and sglang imported; ``VmHWM``
is then reset, and the peak over connect and the first update is what the update added.

    .venv/bin/python benchmarks/footprint.py first-update-memory      # about 4 minutes here
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from typing import Any

from harness import (
    GB,
    hf_bytes,
    machine,
    markdown_table,
    peak_rss_bytes,
    qwen3_config,
    reset_peak_rss,
    rss_bytes,
    write_doc_section,
)

NAME = "first_update_memory"
MiB = 2**20
MODES = ("whole", "streamed")


def child(args: argparse.Namespace) -> int:
    """One trainer: prints one JSON line with the first update's time and memory."""
    import torch
    from sglang.srt.models import qwen3  # noqa: F401 (imported before the baseline)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from p2pweights.adapters import hf_named_tensors
    from p2pweights.config import MooncakeConfig, SyncConfig
    from p2pweights.session import WeightSyncSession
    from p2pweights.testing import model_config

    config = model_config(args.model)
    hf_config = Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"})
    model = Qwen3ForCausalLM(hf_config).float().eval()  # fp32 master weights
    baseline = rss_bytes()
    reset_peak_rss()
    session_config = SyncConfig(
        transport=MooncakeConfig(protocol="tcp"), buffer_bytes=args.buffer, transfer_timeout_s=300
    )
    pairs = hf_named_tensors(model, dtype=torch.bfloat16, bucket_bytes=args.bucket)
    given = pairs if args.mode == "streamed" else (pair for pair in pairs)
    with WeightSyncSession(session_config) as session:
        session.connect([args.engine])
        started = time.perf_counter()
        report = session.update(given)
        seconds = time.perf_counter() - started
        executor = session._connection.executor
        two_buffers = 2 * executor.buffer_bytes if executor is not None else 0
        peak = peak_rss_bytes()
    print(
        json.dumps(
            {
                "mode": args.mode,
                "bytes_written": report.bytes_written,
                "first_s": seconds,
                "stages": report.stage_seconds,
                "baseline_rss": baseline,
                "added_peak": peak - baseline,
                "two_buffers_bytes": two_buffers,
            }
        )
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--buffer", default="256MiB")
    parser.add_argument("--bucket", default="128MiB")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.child:
        child(args)
        return None

    from p2pweights.local_engine import LocalEngine
    from p2pweights.testing import write_model_dir

    config = qwen3_config(args.layers)
    folder = write_model_dir(config, tempfile.mkdtemp(prefix="p2pweights-first-update-"))
    started = time.perf_counter()
    before = machine()
    results: list[dict[str, Any]] = []
    with LocalEngine(folder, tp=1, transport="mooncake") as engine:
        for mode in MODES:
            command = [
                *args.entry, "--child", "--mode", mode, "--model", str(folder),
                "--engine", engine.url, "--buffer", args.buffer, "--bucket", args.bucket,
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"trainer ({mode}) failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    meta = {
        "command": args.command,
        "model_bytes": hf_bytes(config),
        "layers": args.layers,
        "buffer": args.buffer,
        "bucket": args.bucket,
        "machine_before": before,
        "machine_after": machine(),
        "wall_s": time.perf_counter() - started,
    }
    rows = [
        [
            r["mode"],
            f"{r['bytes_written'] / GB:.2f}",
            f"{r['first_s']:.2f}",
            f"{r['two_buffers_bytes'] / MiB:.0f}",
            f"{r['added_peak'] / MiB:.0f}",
            f"{(r['added_peak'] - r['two_buffers_bytes']) / MiB:.0f}",
        ]
        for r in results
    ]
    table = markdown_table(
        [
            "first update",
            "GB written",
            "seconds",
            "2 x buffer MiB",
            "added peak RSS MiB",
            "added - 2 buffers MiB",
        ],
        rows,
    )
    text = (
        f"Command: `{meta['command']}`; a {meta['model_bytes'] / GB:.2f} GB bf16 Qwen3 "
        f"({args.layers} layers) held as fp32 master weights, sent with "
        f"`hf_named_tensors(model, dtype=torch.bfloat16, bucket_bytes={args.bucket})` into "
        f"one local engine (TP 1, Mooncake TCP, same machine); staging buffers {args.buffer}; "
        f"full first `update()` calls, each trainer in a fresh process; machine "
        f"{before['cpus']} cores, load average {before['loadavg_1_5_15']} before "
        f"({before['time']}, {meta['wall_s']:.0f} s).\n\n{table}"
    )
    if not args.no_doc:
        write_doc_section(NAME, text)
    print(text)
    return {"meta": meta, "results": results}
