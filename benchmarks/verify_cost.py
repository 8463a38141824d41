"""What verified writes cost: the same updates with ``SyncConfig.verify_writes`` on and off.

One local engine (TP 1 by default) of ``benchmarks/configs/qwen3-1g.json`` over
Mooncake (TCP loopback), two sessions connected to it: one verifying every update
("always"), one not ("off"). After one warm-up update each, they alternate update by
update (so a slower minute of the shared machine hits both alike). Reported per mode:
the median update time, and for the verifying session its three parts: ``digest``
(this process digesting each staged slot, while the writers send it), ``engine_digest``
(the engine rank digesting its published weights before ``end_weight_update``; the
engine does this at every end, so the "off" run pays it too) and ``verify_writes``
(reading every rank's record and comparing). The cost of the check is their sum,
as a fraction of the verifying update.

    .venv/bin/python benchmarks/verify_cost.py               # about 2 minutes
    .venv/bin/python benchmarks/verify_cost.py --quick       # qwen3-demo
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    CONFIGS,
    GB,
    hf_tensors,
    machine,
    markdown_table,
    median,
    save_json,
    write_doc_section,
)
from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig
from p2pweights.local_engine import LocalEngine
from p2pweights.session import WeightSyncSession
from p2pweights.testing import save_safetensors

NAME = "verify_cost"
PARTS = ("digest", "engine_digest", "verify_writes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CONFIGS / "qwen3-1g.json"))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--buffer", default="256MiB")
    parser.add_argument("--quick", action="store_true", help="qwen3-demo, 2 repeats")
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.model, args.repeats = "qwen3-demo", 2
    logging.basicConfig(level=logging.WARNING)
    command = "python " + " ".join(sys.argv)
    before, started = machine(), time.perf_counter()
    tensors = hf_tensors(args.model)
    transport = MooncakeConfig(protocol="tcp") if args.transport == "mooncake" else NixlConfig()
    modes = {"on": "always", "off": "off"}
    weights = tempfile.mkdtemp(prefix="p2pweights-verify-")
    save_safetensors(weights, tensors)
    reports: dict[str, list[Any]] = {mode: [] for mode in modes}
    with LocalEngine(args.model, tp=args.tp, transport=args.transport, weights=weights) as engine:
        sessions = {
            mode: WeightSyncSession(
                SyncConfig(transport=transport, buffer_bytes=args.buffer, verify_writes=verify)
            )
            for mode, verify in modes.items()
        }
        try:
            for session in sessions.values():
                session.connect([engine.url])
            version = 0
            for repeat in range(args.repeats + 1):  # the first is a warm-up (it probes)
                for mode, session in sessions.items():
                    version += 1
                    report = session.update(tensors, version=str(version))
                    if repeat:
                        reports[mode].append(report)
        finally:
            for session in sessions.values():
                session.close()
    shutil.rmtree(weights, ignore_errors=True)
    seconds = {mode: median([r.seconds for r in rs]) for mode, rs in reports.items()}
    parts = {p: median([r.stage_seconds.get(p, 0.0) for r in reports["on"]]) for p in PARTS}
    cost = sum(parts.values())
    bytes_written = reports["on"][0].bytes_written
    result: dict[str, Any] = {
        "meta": {
            "model": Path(args.model).name,
            "tp": args.tp,
            "transport": args.transport,
            "repeats": args.repeats,
            "machine_before": before,
            "machine_after": machine(),
            "wall_s": time.perf_counter() - started,
            "command": command,
        },
        "bytes_written": bytes_written,
        "median_update_s": seconds,
        "median_parts_s": parts,
        "cost_s": cost,
        "cost_fraction": cost / seconds["on"],
        "updates": {
            mode: [{"seconds": r.seconds, "stages": r.stage_seconds} for r in rs]
            for mode, rs in reports.items()
        },
    }
    save_json(NAME, result)
    rows = [
        ["update, verify_writes='off' (median)", seconds["off"], ""],
        ["update, verify_writes='always' (median)", seconds["on"], 1.0],
        *[[f"  of which {p}", v, v / seconds["on"]] for p, v in parts.items()],
        ["verification (digest + engine_digest + verify_writes)", cost, cost / seconds["on"]],
    ]
    text = (
        f"Command: `{command}`; {result['meta']['model']} ({bytes_written / GB:.3f} GB written "
        f"per update), one engine of TP {args.tp}, {args.transport}; medians of "
        f"{args.repeats} updates per mode after a warm-up, the two sessions alternating; "
        f"load average {before['loadavg_1_5_15']} before, "
        f"{result['meta']['machine_after']['loadavg_1_5_15']} after ({before['time']}).\n\n"
        + markdown_table(["", "seconds", "share of the verifying update"], rows)
        + "\n\nThe engine digests its weights at every `end_weight_update` (it cannot know "
        "whether the trainer verifies), so the 'off' updates include `engine_digest` too; "
        "`digest` runs while the writers send the same bytes."
    )
    if not args.no_doc:
        write_doc_section(NAME, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
