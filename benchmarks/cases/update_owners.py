"""Owner sends against gathered sends: expert-parallel trainer ranks into local engines.

``--ranks`` trainer processes (gloo, CPU) hold a Qwen3-MoE model as expert parallelism
splits it: the attention, norms, router and embeddings whole on every rank, the routed
experts split evenly (rank r owns experts r*E/n .. (r+1)*E/n - 1). Two sessions per rank,
their updates alternating so both see the same machine:

- **owner**: each rank hands ``update()`` what it holds, its experts declared owned
  (``p2pweights.adapters.owned_tensors``): nothing is gathered;
- **gathered**: today's path (the Megatron bridge's export, FSDP2's ``full_tensor()``):
  every rank first all-gathers every layer's experts (``torch.distributed.all_gather`` of
  its stacked experts, as an EP group's export does), then hands the whole model.

Reported per rank and mode (medians of ``--repeats`` warm updates): bytes this rank
received in gathers, the peak resident memory the update added (``VmHWM`` reset before
it, less ``VmRSS`` before it, with glibc giving large allocations back when freed: the
gathered copies; the staging buffers are reserved at connect), the update's wall time
(gather included) and ``UpdateReport.seconds``.

    .venv/bin/python benchmarks/update.py owners                 # 2 ranks, TP 1 engine
    .venv/bin/python benchmarks/update.py owners --ranks 2 --tp 2 --ep 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import CONFIGS, hf_tensors, machine, markdown_table, median

NAME = "owner_sends"
MODES = ("owner", "gathered")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)(\..*)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(CONFIGS / "qwen3-moe-200m.json"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buffer", default="256MiB")


def _split(tensors, rank: int, size: int, num_experts: int):
    """What ``rank`` holds: the replicated tensors, and its experts (owned)."""
    per_rank = num_experts // size
    held, owned = [], set()
    for name, tensor in tensors:
        found = _EXPERT.match(name)
        if found is None:
            held.append((name, tensor))
        elif int(found.group(2)) // per_rank == rank:
            held.append((name, tensor))
            owned.add(name)
    return held, owned


def _gathered(held, owned, size: int):
    """Every rank's experts, all-gathered per (layer, projection) as a stacked tensor;
    the bytes this rank received."""
    import torch
    import torch.distributed as dist

    stacks: dict[tuple[str, str], list[tuple[int, Any]]] = {}
    for name, tensor in held:
        if name in owned:
            prefix, index, suffix = _EXPERT.match(name).groups()  # type: ignore[union-attr]
            stacks.setdefault((prefix, suffix), []).append((int(index), tensor))
    out = [(name, tensor) for name, tensor in held if name not in owned]
    received = 0
    for (prefix, suffix), mine in sorted(stacks.items()):
        mine.sort()
        local = torch.stack([t for _, t in mine])
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local)
        received += (size - 1) * local.numel() * local.element_size()
        per_rank = len(mine)
        for rank, part in enumerate(parts):
            for i in range(per_rank):
                out.append((f"{prefix}{rank * per_rank + i}{suffix}", part[i]))
    return out, received


def _trainer(rank, size, port, model, url, buffer, repeats, queue) -> None:
    import torch.distributed as dist

    from harness import peak_rss_bytes, reset_peak_rss, rss_bytes
    from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
    from p2pweights.adapters import owned_tensors
    from p2pweights.testing import model_config

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    path = Path(model)
    config = json.loads(path.read_text()) if path.is_file() else model_config(model)
    num_experts = config["num_experts"]
    tensors = hf_tensors(model)
    held, owned = _split(tensors, rank, size, num_experts)
    del tensors
    sync = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes=buffer)
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    sessions = {mode: WeightSyncSession.from_torch_distributed(sync) for mode in MODES}
    try:
        for session in sessions.values():
            session.connect([url])
        for step in range(3 + repeats):  # probe, replay recorded, replay confirmed; then measured
            for mode, session in sessions.items():
                dist.barrier()
                before = rss_bytes()
                reset_peak_rss()
                started = time.perf_counter()
                if mode == "owner":
                    report = session.update(owned_tensors(held, owned))
                    received = 0
                else:
                    whole, received = _gathered(held, owned, size)
                    report = session.update(whole)
                    del whole
                wall = time.perf_counter() - started
                peak = peak_rss_bytes() - before
                if step >= 3:
                    rows[mode].append(
                        {
                            "gathered_bytes": received,
                            "peak_added_bytes": peak,
                            "wall_s": wall,
                            "update_s": report.seconds,
                            "bytes_written": sum(report.bytes_by_target.values()),
                        }
                    )
    finally:
        for session in sessions.values():
            session.close()
        dist.destroy_process_group()
    queue.put((rank, rows))


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    import multiprocessing

    from p2pweights.local_engine import LocalEngine, free_port
    from p2pweights.testing import save_safetensors

    logging.basicConfig(level=logging.WARNING)
    before, started = machine(), time.perf_counter()
    tensors = hf_tensors(args.model)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    experts = sum(t.numel() * t.element_size() for n, t in tensors if _EXPERT.match(n))
    weights = tempfile.mkdtemp(prefix="p2pweights-owners-")
    save_safetensors(weights, tensors)
    del tensors
    # large allocations mmapped and given back when freed, so each update's peak resident
    # memory shows what it allocated (glibc otherwise keeps freed arenas for reuse)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    server_args: dict[str, object] = {"ep_size": args.ep} if args.ep > 1 else {}
    try:
        with LocalEngine(
            args.model, tp=args.tp, transport="mooncake", weights=weights, server_args=server_args
        ) as engine:
            port = free_port()
            procs = [
                ctx.Process(
                    target=_trainer,
                    args=(
                        r,
                        args.ranks,
                        port,
                        args.model,
                        engine.url,
                        args.buffer,
                        args.repeats,
                        queue,
                    ),
                )
                for r in range(args.ranks)
            ]
            for p in procs:
                p.start()
            results = dict(queue.get(timeout=1800) for _ in procs)
            for p in procs:
                p.join(timeout=120)
    finally:
        shutil.rmtree(weights, ignore_errors=True)
    summary = {
        mode: {
            rank: {key: median([r[key] for r in rows[mode]]) for key in rows[mode][0]}
            for rank, rows in sorted(results.items())
        }
        for mode in MODES
    }
    table = markdown_table(
        [
            "mode",
            "trainer rank",
            "gathered MB",
            "peak added MB",
            "wall s",
            "update s",
            "written MB",
        ],
        [
            [
                mode,
                rank,
                m["gathered_bytes"] / 1e6,
                m["peak_added_bytes"] / 1e6,
                m["wall_s"],
                m["update_s"],
                m["bytes_written"] / 1e6,
            ]
            for mode, ranks in summary.items()
            for rank, m in ranks.items()
        ],
    )
    print(table)
    return {
        "meta": {
            "model": Path(args.model).name,
            "ranks": args.ranks,
            "tp": args.tp,
            "ep": args.ep,
            "buffer": args.buffer,
            "repeats": args.repeats,
            "bytes": total,
            "expert_bytes": experts,
            "machine_before": before,
            "machine_after": machine(),
            "wall_s": time.perf_counter() - started,
            "command": args.command,
        },
        "median": summary,
        "updates": {str(rank): rows for rank, rows in sorted(results.items())},
    }
