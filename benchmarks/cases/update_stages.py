"""Stage breakdown of an update, from ``UpdateReport.stage_seconds``; the slowest stage named.

One local engine (TP 4 by default) of ``benchmarks/configs/qwen3-1g.json``. The
first update (with ``verify_with_weight_checker``) shows the one-time stages (probe,
verify); the following warm updates give the per-update stages as medians:
control plane (HTTP session routes), load (sglang's loaders into the staging
buffers, on the caller's thread), wait (for writes the loading did not hide).

``--profile`` runs one more warm update with cProfile switched on only inside the
replica's ``load_into`` (the load stage) and splits that time into: the tensor
copies sglang's loaders issue (``copy_``), other torch ops, sglang's Python,
p2pweights' Python, torch's Python and the rest. It then runs one update with the
transport's ``write`` replaced by a no-op ("load alone"): the load stage without
writer threads and engine receive competing for the 2 cores and the GIL.

    .venv/bin/python benchmarks/update.py stages --profile          # about 3 minutes
    .venv/bin/python benchmarks/update.py stages --quick --profile  # qwen3-demo (0.39 GB)
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    CONFIGS,
    GB,
    RESULTS,
    hf_tensors,
    machine,
    markdown_table,
    median,
    write_doc_section,
)
from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig
from p2pweights.local_engine import LocalEngine
from p2pweights.replica.sglang.model_replica import ModelReplica
from p2pweights.session import WeightSyncSession
from p2pweights.testing import save_safetensors

NAME = "stage_breakdown"
STAGES = ("probe", "check_inputs", "control_plane", "load", "wait", "verify")


def paused_s(report: Any) -> float:
    """The longest any engine stood paused for this update (0 where not reported)."""
    return max(getattr(report, "paused_s", {}).values(), default=0.0)


def categorize(stats: pstats.Stats) -> dict[str, float]:
    """Own time (tottime) of every profiled function, summed by where it lives."""
    totals = {
        "copy_ (sglang loaders' tensor copies)": 0.0,
        "other torch ops (C)": 0.0,
        "sglang Python": 0.0,
        "p2pweights Python": 0.0,
        "torch Python": 0.0,
        "other": 0.0,
    }
    for (filename, _, function), entry in stats.stats.items():  # type: ignore[attr-defined]
        own = entry[2]
        if filename == "~" and "copy_" in function:
            totals["copy_ (sglang loaders' tensor copies)"] += own
        elif filename == "~" and ("torch" in function or "Tensor" in function):
            totals["other torch ops (C)"] += own
        elif "/sglang/" in filename:
            totals["sglang Python"] += own
        elif "/p2pweights/" in filename:
            totals["p2pweights Python"] += own
        elif "/torch/" in filename:
            totals["torch Python"] += own
        else:
            totals["other"] += own
    return totals


def top_functions(stats: pstats.Stats, count: int = 12) -> list[list[Any]]:
    rows = []
    entries = stats.stats.items()  # type: ignore[attr-defined]
    for (filename, line, function), entry in sorted(entries, key=lambda kv: -kv[1][2])[:count]:
        where = filename.split("site-packages/")[-1].split("src/")[-1]
        rows.append([f"`{where}:{line} {function}`", entry[1], round(entry[2], 3)])
    return rows


def profiled_update(session: WeightSyncSession, tensors: list) -> tuple[Any, pstats.Stats]:
    profiler = cProfile.Profile()
    original = ModelReplica.load_into

    def load_into(self: ModelReplica, *args: Any, **kwargs: Any) -> None:
        profiler.enable()
        try:
            original(self, *args, **kwargs)
        finally:
            profiler.disable()

    ModelReplica.load_into = load_into  # type: ignore[method-assign]
    try:
        report = session.update(tensors)
    finally:
        ModelReplica.load_into = original  # type: ignore[method-assign]
    return report, pstats.Stats(profiler)


def update_without_writes(session: WeightSyncSession, tensors: list) -> Any:
    """One update whose writes are skipped: the load stage with no transport running."""
    assert session._connection.executor is not None
    transport = session._connection.executor.transport
    original = transport.write
    transport.write = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        return session.update(tensors)
    finally:
        transport.write = original  # type: ignore[method-assign]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(CONFIGS / "qwen3-1g.json"))
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buffer", default="256MiB")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="qwen3-demo, 2 repeats")
    parser.add_argument("--no-doc", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.quick:
        args.model, args.repeats = "qwen3-demo", 2
    logging.basicConfig(level=logging.WARNING)
    command = args.command
    before, started = machine(), time.perf_counter()
    tensors = hf_tensors(args.model)
    transport = MooncakeConfig(protocol="tcp") if args.transport == "mooncake" else NixlConfig()
    # verify_writes off: "load alone" (--profile) writes nothing, so nothing could be
    # verified, and it shares this session (verification came after the recorded runs)
    config = SyncConfig(
        transport=transport,
        buffer_bytes=args.buffer,
        verify_with_weight_checker=True,
        verify_writes="off",
    )
    weights = tempfile.mkdtemp(prefix="p2pweights-stages-")
    save_safetensors(weights, tensors)  # the engine starts from the trainer's tensors
    with (
        LocalEngine(args.model, tp=args.tp, transport=args.transport, weights=weights) as engine,
        WeightSyncSession(config) as session,
    ):
        connect_started = time.perf_counter()
        session.connect([engine.url])
        connect_s = time.perf_counter() - connect_started
        first = session.update(tensors)
        warm = [session.update(tensors) for _ in range(args.repeats)]
        profile = profiled_update(session, tensors) if args.profile else None
        alone = update_without_writes(session, tensors) if args.profile else None
        if alone is not None:
            session.update(tensors)  # put the real weights back
    shutil.rmtree(weights, ignore_errors=True)
    medians = {s: median([r.stage_seconds.get(s, 0.0) for r in warm]) for s in STAGES}
    medians = {s: v for s, v in medians.items() if v > 0}
    total = median([r.seconds for r in warm])
    slowest = max(medians, key=lambda s: medians[s])
    result: dict[str, Any] = {
        "meta": {
            "model": Path(args.model).name,
            "tp": args.tp,
            "transport": args.transport,
            "buffer_bytes": config.buffer_bytes,
            "repeats": args.repeats,
            "machine_before": before,
            "machine_after": machine(),
            "wall_s": time.perf_counter() - started,
            "command": command,
        },
        "bytes_written": first.bytes_written,
        "connect_s": connect_s,
        "first_update": {
            "seconds": first.seconds,
            "stages": first.stage_seconds,
            "paused_s": paused_s(first),
        },
        "warm_updates": [
            {"seconds": r.seconds, "stages": r.stage_seconds, "paused_s": paused_s(r)} for r in warm
        ],
        "median_stages": medians,
        "median_seconds": total,
        "slowest_stage": slowest,
    }
    rows = [
        [s, first.stage_seconds.get(s, 0.0), medians.get(s, 0.0), medians.get(s, 0.0) / total]
        for s in STAGES
        if s in first.stage_seconds or s in medians
    ]
    rows.append(["total (UpdateReport.seconds)", first.seconds, total, 1.0])
    warm_paused = median([paused_s(r) for r in warm])
    rows.append(["engine paused (UpdateReport.paused_s, max)", paused_s(first), warm_paused, ""])
    text = (
        f"Command: `{command}`; {result['meta']['model']} "
        f"({first.bytes_written / GB:.3f} GB written per update), one engine of TP {args.tp}, "
        f"{args.transport}; warm = median of {args.repeats} updates after the first; connect "
        f"took {connect_s:.2f} s; load average {before['loadavg_1_5_15']} before, "
        f"{result['meta']['machine_after']['loadavg_1_5_15']} after "
        f"({before['time']}).\n\n"
        + markdown_table(["stage", "first update s", "warm s (median)", "share of warm"], rows)
        + f"\n\nSlowest warm stage: **{slowest}** ({medians[slowest]:.3f} s of {total:.3f} s)."
    )
    if profile is not None:
        report, stats = profile
        categories = categorize(stats)
        profiled = sum(categories.values())
        assert alone is not None
        result["profile"] = {
            "load_alone_s": alone.stage_seconds["load"],
            "update_without_writes_s": alone.seconds,
            "load_s": report.stage_seconds["load"],
            "profiled_s": profiled,
            "categories": categories,
            "top": top_functions(stats),
        }
        text += (
            f"\n\nLoad stage with the transport's writes skipped (load alone): "
            f"{alone.stage_seconds['load']:.3f} s (update {alone.seconds:.3f} s) vs "
            f"{medians['load']:.3f} s with writes running."
            f"\n\ncProfile of the load stage of one more warm update (load stage "
            f"{report.stage_seconds['load']:.3f} s under the profiler; own time by where the "
            f"code lives):\n\n"
            + markdown_table(
                ["where", "seconds", "share"],
                [[k, v, v / profiled] for k, v in categories.items()],
            )
            + "\n\nTop functions by own time:\n\n"
            + markdown_table(["function", "calls", "own s"], result["profile"]["top"])
        )
    text += f"\n\n![stage breakdown](../benchmarks/results/{NAME}.png)"
    if not args.no_doc:  # the figure belongs to the doc's section: both or neither
        plot(result)
        write_doc_section(NAME, text)
    print(text)
    return result


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.8))
    runs = [("first update", result["first_update"]["stages"]), ("warm", result["median_stages"])]
    for y, (_label, stages) in enumerate(runs):
        left = 0.0
        for stage in STAGES:
            value = stages.get(stage, 0.0)
            if value > 0:
                ax.barh(y, value, left=left, label=stage if y == 0 else None)
                left += value
    ax.set_yticks([0, 1], [label for label, _ in runs])
    ax.set_xlabel("seconds")
    ax.set_title(f"stages of an update ({result['meta']['model']}, TP {result['meta']['tp']})")
    ax.legend(ncol=6, fontsize=8, loc="lower right")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / f"{NAME}.png", dpi=110)
