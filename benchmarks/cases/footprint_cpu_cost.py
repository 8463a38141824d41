"""CPU cost of an update, stage by stage: wall time and CPU seconds of trainer and engine.

One local engine (TP 2 by default) per transport; interleaved in every repeat:

- **ceiling**: each rank's arena as ONE write from one registered source buffer, ranks
  one after the other (``benchmarks/update.py ceiling``'s ceiling);
- **p2p**: ``WeightSyncSession.update`` (``UpdateReport.seconds``);
- **load alone**: the same update with the transport's ``write`` a no-op: sglang's
  loaders into the staging buffers plus the control plane, no bytes moved.

For each, the CPU seconds the trainer process and the engine process used (user +
system, every thread, from ``/proc/<pid>/stat``), so the cost of loading and of
moving bytes are measured apart, per GB written. On a host with ``C`` free cores the
update cannot take less than (load CPU + transfer CPU) / C; p2p / ceiling is then at
most ``ceiling_s / max(ceiling_s, that bound)``. The script also records the time the
trainer spent in Python's cyclic garbage collector during each update.

    .venv/bin/python benchmarks/footprint.py cpu-cost          # qwen3-demo, TP 2, Mooncake
    .venv/bin/python benchmarks/footprint.py cpu-cost --transports mooncake nixl --model <config>
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cases.update_ceiling import BenchTargets, run_ceiling, transport_config
from harness import GB, cpu_seconds, hf_tensors, machine, markdown_table, median, write_doc_section
from p2pweights.config import SyncConfig, Timeouts
from p2pweights.local_engine import LocalEngine
from p2pweights.sync_session import WeightSyncSession
from p2pweights.testing import model_config, save_safetensors, write_model_dir
from p2pweights.transports import Write, create_transport

NAME = "cpu_cost"
TIMEOUT_S = 300.0


class GcClock:
    """Seconds this process spent in the cyclic garbage collector (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections += 1


def measured(engine_pid: int, gc_clock: GcClock, call: Callable[[], Any]) -> dict[str, Any]:
    """Wall seconds, trainer and engine CPU seconds, and GC time of ``call()``."""
    me = os.getpid()
    gc_before, collections_before = gc_clock.seconds, gc_clock.collections
    cpu_trainer, cpu_engine = cpu_seconds(me), cpu_seconds(engine_pid)
    started = time.perf_counter()
    result = call()
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "trainer_cpu_s": cpu_seconds(me) - cpu_trainer,
        "engine_cpu_s": cpu_seconds(engine_pid) - cpu_engine,
        "gc_s": gc_clock.seconds - gc_before,
        "gc_collections": gc_clock.collections - collections_before,
        "result": result,
    }


def run_case(kind: str, tp: int, folder: Path, weights: Path, args: argparse.Namespace) -> dict:
    tensors = hf_tensors(folder)
    engine = LocalEngine(folder, tp=tp, transport=kind, weights=weights, startup_timeout_s=600)
    gc_clock = GcClock()
    rows = []
    with engine:
        assert engine.pid is not None
        targets = BenchTargets(engine, 4096)  # the broadcast area is not used here
        ceiling_bytes = sum(a.num_bytes for a in targets.arenas)
        source = torch.zeros(max(a.num_bytes for a in targets.arenas), dtype=torch.uint8)
        bench = create_transport(transport_config(kind))
        bench.register(source)
        for pub in targets.ranks:
            bench.connect(pub)
        # verify_writes off: "load alone" writes nothing, so nothing could be verified, and
        # the three variants share this session (verification came after the recorded runs)
        config = SyncConfig(
            transport=transport_config(kind),
            verify_writes="off",
            buffer_bytes=args.buffer,
            timeouts=Timeouts(transfer=TIMEOUT_S, read=TIMEOUT_S),
        )
        with WeightSyncSession(config) as session:
            session.connect([engine.url])
            session.update(tensors)  # probe + first update: the warm-up
            assert session._connection.executor is not None
            transport = session._connection.executor.transport
            original_write = transport.write

            def merged_write(target: Any, writes: Any, timeout_s: float) -> None:
                original_write(target, merge_adjacent(writes), timeout_s)

            def update(threads: int, writes: bool, merge: bool = False) -> Any:
                torch.set_num_threads(threads)
                if not writes:
                    transport.write = lambda *a, **k: None  # type: ignore[method-assign]
                elif merge:
                    transport.write = merged_write  # type: ignore[method-assign]
                try:
                    return session.update(tensors)
                finally:
                    transport.write = original_write  # type: ignore[method-assign]
                    torch.set_num_threads(args.threads[0])

            run_ceiling(bench, targets, source)
            for threads in args.threads:
                update(threads, writes=False)
            for repeat in range(args.repeats):
                row: dict[str, Any] = {"repeat": repeat}
                ceiling = measured(
                    engine.pid, gc_clock, lambda: run_ceiling(bench, targets, source)
                )
                row["ceiling"] = {k: v for k, v in ceiling.items() if k != "result"}
                for threads in args.threads:
                    variants = [
                        (f"p2p_{threads}t", True, False),
                        (f"alone_{threads}t", False, False),
                    ]
                    if args.merge_writes:
                        variants.append((f"merged_{threads}t", True, True))
                    for part, writes, merge in variants:
                        got = measured(
                            engine.pid,
                            gc_clock,
                            lambda t=threads, w=writes, m=merge: update(t, w, m),
                        )
                        row[part] = {k: v for k, v in got.items() if k != "result"}
                        row[part]["report_s"] = got["result"].seconds
                        row[part]["stages"] = got["result"].stage_seconds
                        p2p_bytes = got["result"].bytes_written
                rows.append(row)
                logging.info("%s TP%d repeat %d: %s", kind, tp, repeat, row)
        bench.close()
    gc.callbacks.remove(gc_clock._callback)

    result: dict[str, Any] = {
        "transport": kind,
        "tp": tp,
        "p2p_bytes": p2p_bytes,
        "ceiling_bytes": ceiling_bytes,
        "repeats": rows,
    }
    for part in rows[0]:
        if part == "repeat":
            continue
        numbers = [k for k, v in rows[0][part].items() if isinstance(v, (int, float))]
        result[part] = {k: median([r[part][k] for r in rows]) for k in numbers}
        if "stages" in rows[0][part]:
            result[part]["load_stage_s"] = median(
                [r[part]["stages"].get("load", 0.0) for r in rows]
            )
    return result


def merge_adjacent(writes: Any) -> list[Write]:
    """Consecutive writes whose sources and destinations both continue each other, as one."""
    merged: list[Write] = []
    for w in writes:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.src_address + last.num_bytes == w.src_address
            and last.dst_address + last.num_bytes == w.dst_address
            and last.dst_device == w.dst_device
        ):
            merged[-1] = Write(
                last.src_address, last.dst_address, last.num_bytes + w.num_bytes, last.dst_device
            )
        else:
            merged.append(w)
    return merged


def derived(r: dict[str, Any], threads: int, cores: float) -> dict[str, float]:
    p2p, alone = r[f"p2p_{threads}t"], r[f"alone_{threads}t"]
    gb_ceiling, gb_p2p = r["ceiling_bytes"] / GB, r["p2p_bytes"] / GB
    transfer_cpu = (r["ceiling"]["trainer_cpu_s"] + r["ceiling"]["engine_cpu_s"]) / gb_ceiling
    load_cpu = (alone["trainer_cpu_s"] + alone["engine_cpu_s"]) / gb_p2p
    p2p_cpu = (p2p["trainer_cpu_s"] + p2p["engine_cpu_s"]) / gb_p2p
    ceiling_s_per_gb = r["ceiling"]["wall_s"] / gb_ceiling
    bound_s_per_gb = max(ceiling_s_per_gb, (transfer_cpu + load_cpu) / cores)
    return {
        "transfer_cpu_s_per_gb": transfer_cpu,
        "load_cpu_s_per_gb": load_cpu,
        "p2p_cpu_s_per_gb": p2p_cpu,
        "ceiling_s_per_gb": ceiling_s_per_gb,
        "p2p_s_per_gb": p2p["wall_s"] / gb_p2p,
        "ratio": ceiling_s_per_gb / (p2p["wall_s"] / gb_p2p),
        "ratio_bound": ceiling_s_per_gb / bound_s_per_gb,
        # p2p / ceiling >= 0.85 means p2p wall <= ceiling / 0.85: the update's CPU in that time
        "cores_needed_for_085": p2p_cpu / (ceiling_s_per_gb / 0.85),
        "cores_p2p_got": (p2p["trainer_cpu_s"] + p2p["engine_cpu_s"]) / p2p["wall_s"],
    }


def _merged(r: dict[str, Any], threads: int) -> str:
    merged = r.get(f"merged_{threads}t")
    if merged is None:
        return "-"
    return f"{_wall_cpu(merged)}, **{r['ceiling']['wall_s'] / merged['wall_s']:.2f}**"


def _wall_cpu(part: dict[str, float]) -> str:
    return f"{part['wall_s']:.3f} ({part['trainer_cpu_s']:.2f} + {part['engine_cpu_s']:.2f})"


def report(results: list[dict[str, Any]], meta: dict[str, Any], args: argparse.Namespace) -> str:
    rows, rows2 = [], []
    for r in results:
        r["derived"] = {}
        for threads in args.threads:
            d = derived(r, threads, args.cores)
            r["derived"][threads] = d
            p2p, alone = r[f"p2p_{threads}t"], r[f"alone_{threads}t"]
            rows.append(
                [
                    r["transport"],
                    r["tp"],
                    threads,
                    round(r["p2p_bytes"] / GB, 3),
                    _wall_cpu(r["ceiling"]),
                    _wall_cpu(p2p),
                    _wall_cpu(alone),
                    f"{p2p['load_stage_s']:.3f} / {alone['load_stage_s']:.3f}",
                    f"**{d['ratio']:.2f}**",
                    _merged(r, threads),
                ]
            )
            rows2.append(
                [
                    r["transport"],
                    r["tp"],
                    threads,
                    round(d["transfer_cpu_s_per_gb"], 2),
                    round(d["load_cpu_s_per_gb"], 2),
                    round(d["p2p_cpu_s_per_gb"], 2),
                    round(d["ceiling_s_per_gb"], 3),
                    f"{d['ratio_bound']:.2f}",
                    f"{d['cores_needed_for_085']:.2f} / {d['cores_p2p_got']:.2f}",
                    f"{p2p['gc_s']:.3f}",
                ]
            )
    table = markdown_table(
        [
            "transport",
            "TP",
            "torch threads",
            "GB written",
            "ceiling s (CPU s: trainer + engine)",
            "p2p s (CPU s)",
            "load alone s (CPU s)",
            "load stage s: p2p / alone",
            "p2p / ceiling",
            "adjacent writes merged: p2p s (CPU s), p2p / ceiling",
        ],
        rows,
    )
    table2 = markdown_table(
        [
            "transport",
            "TP",
            "torch threads",
            "transfer CPU s/GB",
            "load CPU s/GB",
            "p2p CPU s/GB",
            "ceiling wall s/GB",
            f"p2p / ceiling possible on {args.cores:g} free cores",
            "cores p2p needs for 0.85 / cores it got",
            "GC s in p2p",
        ],
        rows2,
    )
    return (
        f"Command: `{args.command}`; medians of "
        f"{args.repeats} repeats after a warm-up, ceiling and each variant interleaved in every "
        f"repeat; model {Path(args.model).name}; staging buffers 2 x {args.buffer}; "
        f"{meta['before']['cpus']} cores, load average {meta['before']['loadavg_1_5_15']} before, "
        f"{meta['after']['loadavg_1_5_15']} after ({meta['before']['time']}).\n\n{table}\n\n"
        f"{table2}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-demo", help="a shipped model or a config path")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--transports", nargs="+", default=["mooncake"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer", default="256MiB")
    parser.add_argument("--cores", type=float, default=2.0, help="cores for the bound")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[torch.get_num_threads(), 1],
        help="torch intra-op threads of the trainer, one variant each (default: as is, and 1)",
    )
    parser.add_argument(
        "--merge-writes",
        action="store_true",
        help="one more variant: adjacent writes merged before the transport sees them",
    )
    parser.add_argument(
        "--no-doc", action="store_true", help="do not touch docs/benchmarks-archive.md"
    )


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="p2pweights-cpu-"))
    try:
        folder = write_model_dir(model_config(args.model), work / "model")
        weights = work / "weights"
        save_safetensors(weights, hf_tensors(folder))
        meta = {"before": machine()}
        results = [run_case(kind, args.tp, folder, weights, args) for kind in args.transports]
        meta["after"] = machine()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(results, meta, args)
    print(text)
    if not args.no_doc:
        write_doc_section(NAME, text)
    options = {k: v for k, v in vars(args).items() if k not in ("entry", "command")}
    return {"meta": meta, "args": options, "results": results}
