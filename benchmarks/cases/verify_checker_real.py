"""What verification costs on a real sglang server on this CPU: sglang's own
``/weights_checker`` before the end, the plugin's write digests, and no check, side by side.

Two real sglang 0.5.23 servers (CPU backend, TP 1, the p2pweights NIXL plugin publishing)
serve one model from the same checkpoint: one started with ``P2PWEIGHTS_WRITE_DIGESTS=0``
(records no digests, as released sglang publishing through its own Mooncake flag does),
one with the plugin's digests on (the default). Three sessions write them over NIXL (UCX):

* ``off``: ``verify_writes="off"`` into the server without digests: no check;
* ``checker``: ``verify_writes="always"`` into the same server: the trainer hashes what it
  staged with sglang's own function (sha256 on a CPU), and after the writes, before
  ``end_weight_update``, sglang's ``/weights_checker`` hashes every parameter it holds
  (``verified_by == ("weights_checker",)``);
* ``digests``: ``verify_writes="always"`` into the server with digests: each engine rank
  digests its parameters inside its end, and the trainer compares the record.

Both servers run with ``--sleep-on-idle``: an idle CPU server's scheduler otherwise polls,
and on this 2-core machine the idle one's polling made the other's pause calls take
0.2-9 s at random (seen: the same sessions on one server alone took 0.2 s every time).
After two warm-up updates per session (the first connects and probes) the sessions take
turns update by update, the order rotating every repeat, so none always follows another
and a slower minute of the shared machine hits all alike. The cost of each check is the
difference of the median updates (and pauses), as a fraction of the unchecked one.
Needs sglang's CPU kernel (``bash scripts/real-sglang.sh build``)::

    eval "$(bash scripts/real-sglang.sh env)"
    .venv/bin/python benchmarks/verify.py checker-real --model qwen3-demo --repeats 6
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cases.verify_cost import compared
from harness import ROOT, hf_tensors, machine, markdown_table, named_config

sys.path.insert(0, str(ROOT / "tests" / "real_sglang"))

NAME = "verify_checker_real"
MODES = {"off": ("off", False), "checker": ("always", False), "digests": ("always", True)}
"""Mode -> (``verify_writes``, whether its server records write digests)."""
EXPECTED = {"off": (), "checker": ("weights_checker",), "digests": ("write_digests",)}
PARTS = ("checksum", "verify_checker", "digest", "engine_digest", "verify_writes")
"""Stages of the report each check adds: the checker's (the sender's hashes, the
``/weights_checker`` call) and the digests' (the sender's, the engine's, the compare)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="qwen3-demo", help="a model of benchmarks/configs or shipped"
    )
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--buffer", default="256MiB")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--logs", type=Path, default=None, help="where the servers' logs go")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _server import RealServer, remove_left_behind, shared_memory_files, unavailable

    from p2pweights.config import NixlConfig, SyncConfig, Timeouts
    from p2pweights.sync_session import WeightSyncSession
    from p2pweights.testing import save_safetensors, write_model_dir

    why = unavailable()
    if why is not None:
        raise SystemExit(f"verify checker-real: {why}")
    logging.basicConfig(level=logging.WARNING)
    modes = list(dict.fromkeys(["off", *args.modes]))  # the baseline, always
    config = named_config(args.model)
    folder = Path(tempfile.mkdtemp(prefix="p2pweights-checker-real-"))
    logs = args.logs or folder / "logs"
    write_model_dir(config, folder)
    save_safetensors(folder, hf_tensors(config, seed=0))
    updates = [dict(hf_tensors(config, seed=seed)) for seed in (1, 2)]
    before_shm, before, started = shared_memory_files(), machine(), time.perf_counter()
    servers = {
        digests: RealServer(
            folder,
            1,
            logs / f"digests-{digests}.log",
            digests=digests,
            model_args=("--sleep-on-idle",),
        )
        for digests in sorted({MODES[mode][1] for mode in modes})
    }
    sessions: dict[str, Any] = {}
    reports: dict[str, list[Any]] = {mode: [] for mode in modes}
    try:
        for server in servers.values():  # one at a time: two starting at once starve 2 cores
            server.start()
            server.wait_ready(timeout_s=900)
        for mode in modes:
            verify, digests = MODES[mode]
            sync = SyncConfig(
                transport=NixlConfig(backend="UCX"),
                buffer_bytes=args.buffer,
                verify_writes=verify,
                timeouts=Timeouts(transfer=300),
            )
            sessions[mode] = WeightSyncSession(sync)
            sessions[mode].connect([servers[digests].url])
        version = 0
        for warm in range(2):
            for mode in modes:
                version += 1
                sessions[mode].update(updates[warm % 2], version=f"warm-{version}")
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]
            for mode in order:
                version += 1
                report = sessions[mode].update(updates[repeat % 2], version=str(version))
                reports[mode].append(report)
    finally:
        for session in sessions.values():
            session.close()
        for server in servers.values():
            server.stop()
        remove_left_behind(before_shm)
        shutil.rmtree(folder, ignore_errors=True)
    for mode, rs in reports.items():
        seen = {tuple(e.verified_by) for r in rs for e in r.engines.values()}
        if seen != {EXPECTED[mode]}:
            raise SystemExit(f"verify checker-real: {mode} updates were verified by {seen}")
    result = {**compared(reports, PARTS), "verified_by": {m: list(EXPECTED[m]) for m in modes}}
    result["meta"] = {
        "model": args.model,
        "config": config,
        "repeats": args.repeats,
        "buffer": args.buffer,
        "machine_before": before,
        "machine_after": machine(),
        "wall_s": time.perf_counter() - started,
        "command": args.command,
    }
    print(describe(result))
    return result


def describe(result: dict[str, Any]) -> str:
    meta = result["meta"]
    rows = [
        [
            mode,
            ", ".join(result["verified_by"][mode]) or "-",
            f"{result['median_update_s'][mode] * 1e3:.0f} ms",
            f"{result['median_paused_s'][mode] * 1e3:.0f} ms",
            "-" if mode == "off" else f"{result['cost_fraction'][mode] * 100:+.1f} %",
            "-" if mode == "off" else f"{result['pause_cost_fraction'][mode] * 100:+.1f} %",
        ]
        for mode in result["median_update_s"]
    ]
    head = (
        f"Real sglang 0.5.23 servers on this CPU ({meta['machine_before']['cpus']} cores), "
        f"TP 1, NIXL (UCX), {meta['model']}: {result['bytes_written'] / 1e6:.0f} MB per "
        f"update, medians of {meta['repeats']} updates per mode, taking turns.\n\n"
    )
    table = markdown_table(
        ["mode", "verified by", "update", "pause", "update cost", "pause cost"], rows
    )
    return head + table + "\n\n" + json.dumps(result["median_parts_s"], indent=1)
