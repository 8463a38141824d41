"""Why the load stage slows down while writes run: CPU contention or the GIL?

One local engine (TP 4 by default) of ``benchmarks/configs/qwen3-1g.json``. The
load stage of an update whose own writes are skipped (the transport's ``write`` is a
no-op) is measured while background traffic of the same transport runs into the
same engine:

- ``none``: no background traffic (the load alone);
- ``thread, 1 write/rank``: a thread of the trainer process writes each rank's arena
  as one write (few polls of Mooncake's status from Python);
- ``thread, 1 write/param``: a thread of the trainer process writes every parameter
  as its own write, as an update does (one submission and one status poll per write);
- ``process, 1 write/param``: the same writes from another process (same CPU load on
  the 2 cores, no shared GIL);
- ``none`` once more at the end, as the load stage speeds up over the first updates.

    .venv/bin/python benchmarks/update.py load-contention     # about 3 minutes here
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import tempfile
import threading
import time
from typing import Any

import torch

from cases.update_stages import update_without_writes
from harness import CONFIGS, hf_tensors, machine, markdown_table, median
from p2pweights.config import MooncakeConfig, SyncConfig
from p2pweights.engine_rank.delta_scratch import SCRATCH_NAME
from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import LocalEngine
from p2pweights.session import WeightSyncSession
from p2pweights.testing import save_safetensors
from p2pweights.transports import Write, create_transport
from p2pweights.wire.publication import RankPublication

NAME = "load_contention"


def traffic(url: str, tp: int, per_param: bool, stop: Any) -> None:
    """Write into every rank of ``url`` until ``stop`` is set (a thread or a process)."""
    client = EngineClient(url)
    pubs = [client.publication(rank) for rank in range(tp)]
    transport = create_transport(MooncakeConfig(protocol="tcp"))
    largest = max(sum(r.num_bytes for r in p.regions.values()) for p in pubs)
    source = torch.zeros(largest + 2**20, dtype=torch.uint8)
    transport.register(source)
    plans: list[tuple[RankPublication, list[Write]]] = []
    for pub in pubs:
        # the weights only: the delta scratch is published beside them from its own memory
        regions = sorted(
            (r for name, r in pub.regions.items() if name != SCRATCH_NAME), key=lambda r: r.address
        )
        if per_param:
            writes = [Write(source.data_ptr(), r.address, r.num_bytes) for r in regions]
        else:
            end = max(r.end for r in regions)
            writes = [Write(source.data_ptr(), regions[0].address, end - regions[0].address)]
        transport.connect(pub)
        plans.append((pub, writes))
    while not stop.is_set():
        for pub, writes in plans:
            transport.write(pub, writes, 300.0)
    transport.close()
    client.close()


def measure(session: WeightSyncSession, tensors: list, repeats: int) -> list[float]:
    return [update_without_writes(session, tensors).stage_seconds["load"] for _ in range(repeats)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(CONFIGS / "qwen3-1g.json"))
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    logging.basicConfig(level=logging.WARNING)
    before = machine()
    tensors = hf_tensors(args.model)
    weights = tempfile.mkdtemp(prefix="p2pweights-contention-")
    save_safetensors(weights, tensors)
    # verify_writes off: the measured updates write nothing, so nothing could be verified
    # (and verification came after the recorded runs)
    config = SyncConfig(
        transport=MooncakeConfig(protocol="tcp"), buffer_bytes=256 * 2**20, verify_writes="off"
    )
    rows: dict[str, list[float]] = {}
    with (
        LocalEngine(args.model, tp=args.tp, weights=weights) as engine,
        WeightSyncSession(config) as session,
    ):
        session.connect([engine.url])
        session.update(tensors)  # probe, warm-up
        rows["none"] = measure(session, tensors, args.repeats)
        for label, per_param in (("thread, 1 write/rank", False), ("thread, 1 write/param", True)):
            stop = threading.Event()
            worker = threading.Thread(target=traffic, args=(engine.url, args.tp, per_param, stop))
            worker.start()
            time.sleep(3.0)  # let it connect and stream
            rows[label] = measure(session, tensors, args.repeats)
            stop.set()
            worker.join()
        context = multiprocessing.get_context("spawn")
        stop_process = context.Event()
        process = context.Process(
            target=traffic, args=(engine.url, args.tp, True, stop_process), daemon=True
        )
        process.start()
        time.sleep(8.0)  # spawn imports torch and p2pweights first
        rows["process, 1 write/param"] = measure(session, tensors, args.repeats)
        stop_process.set()
        process.join(timeout=60)
        # the load stage speeds up over the first few updates: measure the baseline again
        rows["none (again, last)"] = measure(session, tensors, args.repeats)
        session.update(tensors)  # put the real weights back
    result = {
        "meta": {"tp": args.tp, "machine_before": before, "machine_after": machine()},
        "load_s": rows,
        "median_load_s": {k: median(v) for k, v in rows.items()},
    }
    base = result["median_load_s"]["none (again, last)"]
    print(
        f"Command: `{args.command}`; TP {args.tp}, Mooncake TCP, load "
        f"average {before['loadavg_1_5_15']} before, "
        f"{result['meta']['machine_after']['loadavg_1_5_15']} after ({before['time']}).\n\n"
        + markdown_table(
            ["background traffic", "load stage s (median)", "x load alone"],
            [[k, v, v / base] for k, v in result["median_load_s"].items()],
        )
    )
    return result
