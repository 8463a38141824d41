"""Update vs ceiling vs broadcast: one run, same model, same engines, same transport.

For each transport (Mooncake TCP, NIXL UCX) and each engine layout (TP 1, 2, 4) one
local engine of ``benchmarks/configs/qwen3-1g.json`` (1.01 GB of bf16) is started,
and, interleaved in every repeat (so the machine's load hits all three alike):

- **ceiling**: each engine rank's weight arena written as ONE contiguous write from
  one registered source buffer, ranks one after the other (one writer thread per
  engine, as a p2pweights update has); no replica, no packing, no control plane;
- **p2p**: ``WeightSyncSession.update`` of the full HF tensor set (warm: the first
  update, with the probe, is the warm-up); its ``UpdateReport.seconds``;
- **broadcast**: what an NCCL broadcast update does at the engine, with the
  broadcast replaced by writes over the same transport: pause, flush, begin, the
  full HF bytes (packed once, before timing, in a registered source buffer) written
  to every rank's broadcast area, sglang's ``load_weights`` on every rank from views
  of that area (``/p2pweights/apply_broadcast``), version, end, continue.

Reported: medians after the warm-up of p2p/ceiling (time ratio ceiling_s / p2p_s,
i.e. efficiency), broadcast/p2p (speed-up), and the byte ratio broadcast_bytes /
p2p_bytes. The local engine runs its ranks in one process, one after the other; a
real engine runs them on separate GPUs in parallel, so ``broadcast_par_s`` (writes
+ the slowest rank's load) is reported next to the measured wall time.

    .venv/bin/python benchmarks/update.py ceiling            # 10-14 minutes here (load 8-11)
    .venv/bin/python benchmarks/update.py ceiling --quick    # TP 1 and 2, Mooncake
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from harness import (
    CONFIGS,
    GB,
    RESULTS,
    hf_tensors,
    machine,
    markdown_table,
    median,
    save_json,
    timed,
    write_doc_section,
)
from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig, Timeouts
from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import LocalEngine
from p2pweights.sync_session import WeightSyncSession
from p2pweights.testing import save_safetensors
from p2pweights.transfer.buffers import aligned
from p2pweights.transports import Transport, Write, create_transport
from p2pweights.wire.publication import RankPublication, WeightRegion, parse_publication

NAME = "update_vs_ceiling"
TIMEOUT_S = 300.0


def transport_config(kind: str) -> MooncakeConfig | NixlConfig:
    return MooncakeConfig(protocol="tcp") if kind == "mooncake" else NixlConfig(backend="UCX")


def pack(tensors: list[tuple[str, torch.Tensor]], num_bytes: int) -> tuple[torch.Tensor, list]:
    """The HF tensors packed back to back (256-byte aligned) in one flat source buffer."""
    source = torch.zeros(num_bytes, dtype=torch.uint8)
    manifest, offset = [], 0
    for name, tensor in tensors:
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        source[offset : offset + flat.numel()].copy_(flat)
        manifest.append(
            [name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset]
        )
        offset += aligned(flat.numel())
    return source, manifest


def packed_bytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(aligned(t.numel() * t.element_size()) for _, t in tensors)


def arena_of(pub: RankPublication) -> WeightRegion:
    """The rank's weight arena: the span of its published parameters (one region); the
    delta scratch, published beside them from its own allocation, is not part of it."""
    from p2pweights.engine_side.delta_scratch import SCRATCH_NAME

    regions = [r for name, r in pub.regions.items() if name != SCRATCH_NAME]
    start = min(r.address for r in regions)
    end = max(r.end for r in regions)
    return WeightRegion(start, end - start, regions[0].gpu_id)


class BenchTargets:
    """Per rank: the arena (ceiling) and the broadcast area, behind one publication."""

    def __init__(self, engine: LocalEngine, area_bytes: int):
        client = EngineClient(engine.url, timeout_s=TIMEOUT_S)
        answer = httpx.post(
            f"{engine.url}/p2pweights/broadcast_area",
            json={"num_bytes": area_bytes},
            timeout=TIMEOUT_S,
        )
        answer.raise_for_status()
        self.ranks: list[RankPublication] = []
        self.arenas: list[WeightRegion] = []
        self.areas: list[WeightRegion] = []
        for entry in answer.json()["ranks"]:
            rank = int(entry["rank"])
            area_pub = parse_publication(engine.url, rank, entry)
            area = next(iter(area_pub.regions.values()))
            arena = arena_of(client.publication(rank))
            # one publication naming both regions, with the latest agent metadata (NIXL)
            self.ranks.append(dataclasses.replace(area_pub, regions={"arena": arena, "area": area}))
            self.arenas.append(arena)
            self.areas.append(area)
        client.close()


def run_ceiling(transport: Transport, targets: BenchTargets, source: torch.Tensor) -> float:
    started = time.perf_counter()
    for pub, arena in zip(targets.ranks, targets.arenas, strict=True):
        transport.write(pub, [Write(source.data_ptr(), arena.address, arena.num_bytes)], TIMEOUT_S)
    return time.perf_counter() - started


def run_broadcast(
    transport: Transport,
    targets: BenchTargets,
    client: EngineClient,
    url: str,
    source: torch.Tensor,
    manifest: list,
    num_bytes: int,
) -> dict[str, Any]:
    stages: dict[str, float] = {}
    started = time.perf_counter()
    with timed(stages, "control_plane"):
        client.pause_generation("retract")
        client.flush_cache()
        client.begin_weight_update("all")
    with timed(stages, "write"):
        for pub, area in zip(targets.ranks, targets.areas, strict=True):
            transport.write(pub, [Write(source.data_ptr(), area.address, num_bytes)], TIMEOUT_S)
    with timed(stages, "apply"):
        answer = httpx.post(
            f"{url}/p2pweights/apply_broadcast", json={"tensors": manifest}, timeout=TIMEOUT_S
        )
        answer.raise_for_status()
    with timed(stages, "control_plane"):
        client.update_weight_version(f"broadcast-{time.monotonic_ns()}")
        client.end_weight_update()
        client.continue_generation()
    rank_seconds = answer.json()["rank_seconds"]
    return {
        "seconds": time.perf_counter() - started,
        "stages": stages,
        "rank_apply_s": rank_seconds,
        # ranks of a real engine load in parallel (one GPU each): the slowest rank counts
        "par_seconds": time.perf_counter() - started - stages["apply"] + max(rank_seconds),
    }


def run_case(
    kind: str,
    tp: int,
    model: Path,
    tensors: list[tuple[str, torch.Tensor]],
    source: torch.Tensor,
    manifest: list,
    args: argparse.Namespace,
    weights: str,
) -> dict[str, Any]:
    hf_total = sum(t.numel() * t.element_size() for _, t in tensors)
    area_bytes = packed_bytes(tensors)
    engine = LocalEngine(model, tp=tp, transport=kind, weights=weights, startup_timeout_s=600)
    with engine:
        targets = BenchTargets(engine, area_bytes)
        assert max(a.num_bytes for a in targets.arenas) <= source.numel()
        client = EngineClient(engine.url, timeout_s=TIMEOUT_S)
        bench = create_transport(transport_config(kind))
        bench.register(source)
        for pub in targets.ranks:
            bench.connect(pub)
        config = SyncConfig(
            transport=transport_config(kind),
            buffer_bytes=args.buffer,
            timeouts=Timeouts(transfer=TIMEOUT_S, read=TIMEOUT_S),
        )
        rows: list[dict[str, Any]] = []
        with WeightSyncSession(config) as session:
            session.connect([engine.url])
            warm = session.update(tensors)  # probe + first update: the warm-up
            run_ceiling(bench, targets, source)
            run_broadcast(bench, targets, client, engine.url, source, manifest, area_bytes)
            for repeat in range(args.repeats):
                ceiling_s = run_ceiling(bench, targets, source)
                report = session.update(tensors)
                broadcast = run_broadcast(
                    bench, targets, client, engine.url, source, manifest, area_bytes
                )
                rows.append(
                    {
                        "repeat": repeat,
                        "ceiling_s": ceiling_s,
                        "p2p_s": report.seconds,
                        "p2p_stages": report.stage_seconds,
                        "p2p_paused_s": max(getattr(report, "paused_s", {}).values(), default=0.0),
                        "broadcast_s": broadcast["seconds"],
                        "broadcast_par_s": broadcast["par_seconds"],
                        "broadcast_stages": broadcast["stages"],
                        "broadcast_rank_apply": broadcast["rank_apply_s"],
                    }
                )
                logging.info("%s TP%d repeat %d: %s", kind, tp, repeat, rows[-1])
            p2p_bytes = report.bytes_written
        bench.close()
        client.close()
    ceiling_bytes = sum(a.num_bytes for a in targets.arenas)
    broadcast_bytes = hf_total * tp
    med = {key: median([r[key] for r in rows]) for key in rows[0] if key.endswith("_s")}
    return {
        "transport": kind,
        "tp": tp,
        "hf_bytes": hf_total,
        "p2p_bytes": p2p_bytes,
        "ceiling_bytes": ceiling_bytes,
        "broadcast_bytes": broadcast_bytes,
        "byte_ratio": broadcast_bytes / p2p_bytes,
        "warmup_s": warm.seconds,
        "warmup_stages": warm.stage_seconds,
        "median": med,
        "median_p2p_stages": {
            k: median([r["p2p_stages"].get(k, 0.0) for r in rows]) for k in rows[0]["p2p_stages"]
        },
        "median_broadcast_stages": {
            k: median([r["broadcast_stages"][k] for r in rows]) for k in rows[0]["broadcast_stages"]
        },
        "efficiency": med["ceiling_s"] / med["p2p_s"],
        "speedup": med["broadcast_s"] / med["p2p_s"],
        "speedup_par": med["broadcast_par_s"] / med["p2p_s"],
        "repeats": rows,
    }


def report(results: list[dict[str, Any]], meta: dict[str, Any], command: str) -> str:
    rows = []
    for r in results:
        m = r["median"]
        speedup_target = 0.75 * r["byte_ratio"]
        rows.append(
            [
                r["transport"],
                r["tp"],
                f"{r['p2p_bytes'] / GB:.3f}",
                f"{m['ceiling_s']:.3f} ({r['ceiling_bytes'] / m['ceiling_s'] / GB:.2f} GB/s)",
                f"{m['p2p_s']:.3f} ({r['p2p_bytes'] / m['p2p_s'] / GB:.2f} GB/s)",
                f"{m['broadcast_s']:.3f} / {m['broadcast_par_s']:.3f}",
                f"**{r['efficiency']:.2f}** {'met' if r['efficiency'] >= 0.85 else 'MISSED'}",
                f"{r['byte_ratio']:.2f}",
                f"**{r['speedup']:.2f}** / {r['speedup_par']:.2f}"
                + (
                    ""
                    if r["tp"] < 2
                    else f" (target {speedup_target:.2f}: "
                    f"{'met' if r['speedup'] >= speedup_target else 'MISSED'})"
                ),
            ]
        )
    table = markdown_table(
        [
            "transport",
            "TP",
            "p2p GB",
            "ceiling s",
            "p2p s",
            "broadcast s (wall / ranks parallel)",
            "p2p/ceiling (>= 0.85)",
            "byte ratio",
            "broadcast/p2p (wall / parallel)",
        ],
        rows,
    )
    stages = markdown_table(
        [
            "transport",
            "TP",
            "p2p load s",
            "p2p wait s",
            "p2p control s",
            "p2p paused s",
            "bcast write s",
            "bcast apply s",
        ],
        [
            [
                r["transport"],
                r["tp"],
                r["median_p2p_stages"].get("load", 0.0),
                r["median_p2p_stages"].get("wait", 0.0),
                r["median_p2p_stages"].get("control_plane", 0.0),
                r["median"]["p2p_paused_s"],
                r["median_broadcast_stages"]["write"],
                r["median_broadcast_stages"]["apply"],
            ]
            for r in results
        ],
    )
    load = meta["machine_before"]["loadavg_1_5_15"], meta["machine_after"]["loadavg_1_5_15"]
    return (
        f"Command: `{command}`; medians of {meta['repeats']} repeats after one warm-up; "
        f"model {meta['model']} ({results[0]['hf_bytes'] / GB:.3f} GB bf16); "
        f"staging buffers 2 x {meta['buffer_bytes'] / 2**20:.0f} MiB; machine "
        f"{meta['machine_before']['cpus']} cores, load average (1/5/15 min) {load[0]} before "
        f"and {load[1]} after the run ({meta['machine_before']['time']}, "
        f"{meta['wall_s']:.0f} s).\n\n{table}\n\nMedian stage seconds:\n\n{stages}\n\n"
        f"Figure: `benchmarks/results/{NAME}.png` (written by the run, not kept in git)."
    )


def plot(results: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['transport']}\nTP {r['tp']}" for r in results]
    xs = range(len(results))
    width = 0.27
    for i, (key, label) in enumerate(
        [
            ("ceiling_s", "ceiling (one write/rank)"),
            ("p2p_s", "p2pweights update"),
            ("broadcast_s", "broadcast baseline"),
        ]
    ):
        ax.bar(
            [x + (i - 1) * width for x in xs],
            [r["median"][key] for r in results],
            width,
            label=label,
        )
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("seconds (median)")
    ax.set_title("1 GB bf16 Qwen3: update vs transport ceiling vs broadcast (CPU, loopback)")
    ax.legend()
    fig.tight_layout()
    path = RESULTS / f"{NAME}.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(CONFIGS / "qwen3-1g.json"))
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--transports", nargs="+", default=["mooncake", "nixl"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--buffer", default="256MiB")
    parser.add_argument("--quick", action="store_true", help="TP 1 and 2, Mooncake, 2 repeats")
    parser.add_argument(
        "--no-doc", action="store_true", help="do not touch docs/benchmarks-archive.md"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the cases of results/update_vs_ceiling.partial.json; measure the rest",
    )


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.quick:
        args.tps, args.transports, args.repeats = [1, 2], ["mooncake"], 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("p2pweights").setLevel(logging.WARNING)
    command = args.command
    started = time.perf_counter()
    before = machine()
    tensors = hf_tensors(args.model)
    manifest_bytes = packed_bytes(tensors)
    source, manifest = pack(tensors, int(manifest_bytes * 1.05))  # > any rank's arena
    # engines start from the same tensors read from safetensors (faster than regenerating)
    weights = tempfile.mkdtemp(prefix="p2pweights-bench-weights-")
    save_safetensors(weights, tensors)
    partial = RESULTS / f"{NAME}.partial.json"
    results = json.loads(partial.read_text())["results"] if args.resume else []
    done = {(r["transport"], r["tp"]) for r in results}
    try:
        for kind in args.transports:
            for tp in args.tps:
                if (kind, tp) in done:
                    continue
                results.append(
                    run_case(kind, tp, Path(args.model), tensors, source, manifest, args, weights)
                )
                logging.info(
                    "%s TP%d: %s",
                    kind,
                    tp,
                    {k: results[-1][k] for k in ("efficiency", "speedup", "byte_ratio")},
                )
                save_json(NAME + ".partial", {"results": results, "started": before})
    finally:
        shutil.rmtree(weights, ignore_errors=True)
    meta = {
        "model": Path(args.model).name,
        "repeats": args.repeats,
        "buffer_bytes": SyncConfig(buffer_bytes=args.buffer).buffer_bytes,
        "machine_before": before,
        "machine_after": machine(),
        "wall_s": time.perf_counter() - started,
        "command": command,
    }
    partial.unlink(missing_ok=True)
    text = report(results, meta, command)
    if not args.no_doc:  # the figure belongs to the doc's section: both or neither
        plot(results)
        write_doc_section(NAME, text)
    print(text)
    return {"meta": meta, "results": results}
