"""The plan at the field's layouts: bytes, lower bounds, our predicted update, their measured times.

For each row of the seed's profiling table and each best published number of another
system, ``p2pweights.planner.build_cluster_plan`` builds every engine rank's replica on
meta at that system's layout (the only source of what a rank holds), assigns writers
as a session would and costs the update (``p2pweights.plan.cost``). Nothing here is a
measurement of those systems: their times are copied from what they published.

    .venv/bin/python benchmarks/replica.py plan-vs-field [--doc docs/plan-vs-field.md]

Writes ``benchmarks/results/plan_vs_field.json`` and the generated section of the doc
(between its ``plan_vs_field`` markers). About 5 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

FP8_128 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
SEED_KIMI_FINISH_S = 0.884
"""Kimi-K2's GPU-side post_load_weights (fp8 requantization) inside the seed's RDMA time."""


@dataclass(frozen=True)
class Row:
    key: str
    system: str
    setup: str
    model: str
    engines: tuple[str, ...]
    senders: int
    stages: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    """Overrides of the shipped config (e.g. fp8 block size)."""
    measured_s: float | None = None
    """Their published P2P (or whatever their method is) update time."""
    measured_broadcast_s: float | None = None
    """The seed's NCCL broadcast time for the same setup."""
    engine_finish_s: float = 0.0
    same_plan_as: str | None = None


KIMI_SEED_ENGINES = ("tp=32,ep=32,count=8",)
ROWS = [
    Row(
        "seed-qwen3",
        "miles P2P (seed)",
        "Qwen3-235B-A22B bf16; trainer 64 H100 (TP 4, PP 4, CP 2, EP 16); 2 engines TP 32 / EP 32",
        "qwen3-235b-a22b-full",
        ("tp=32,ep=32,count=2",),
        senders=64,
        stages=4,
        measured_s=3.162,
        measured_broadcast_s=10.754,
    ),
    Row(
        "seed-glm5",
        "miles P2P (seed)",
        "GLM-5 744B bf16; trainer 128 H100 (TP 4, PP 8, CP 2, EP 16); 2 engines TP 64 / EP 64",
        "glm-5-full",
        ("tp=64,ep=64,count=2",),
        senders=128,
        stages=8,
        measured_s=8.480,
        measured_broadcast_s=58.302,
    ),
    Row(
        "seed-kimi",
        "miles P2P (seed)",
        "Kimi-K2 1T fp8 (blocks 64 x 64); trainer 256 H100 (TP 8, PP 8, CP 4, EP 32); "
        "8 engines TP 32 / EP 32",
        "kimi-k2-full",
        KIMI_SEED_ENGINES,
        senders=256,
        stages=8,
        config={"quantization_config": {**FP8_128, "weight_block_size": [64, 64]}},
        measured_s=7.227,
        measured_broadcast_s=53.279,
        engine_finish_s=SEED_KIMI_FINISH_S,
    ),
    Row(
        "vllm-dp8",
        "vLLM sharded_rdt",
        "Qwen3-235B-A22B bf16; 8 H100 -> 1 engine of 8 H100, DP 8 / EP 8 (DP attention)",
        "qwen3-235b-a22b-full",
        ("tp=8,ep=8,dp_attention=8",),
        senders=8,
        measured_s=3.3,
    ),
    Row(
        "vllm-tp8",
        "vLLM sharded_rdt",
        "Qwen3-235B-A22B bf16; 8 H100 -> 1 engine of 8 H100, TP 8",
        "qwen3-235b-a22b-full",
        ("tp=8",),
        senders=8,
        measured_s=6.1,
    ),
    Row(
        "prime-rl",
        "prime-rl (NIXL)",
        "GLM-5-class fp8 (blocks 128 x 128); 64 H200 -> 32 H200 as 4 engines TP 8 / EP 8 / "
        "DP attention 8 (engine layout assumed)",
        "glm-5-full",
        ("tp=8,ep=8,dp_attention=8,count=4",),
        senders=64,
        config={"quantization_config": FP8_128},
        measured_s=2.84,
        engine_finish_s=SEED_KIMI_FINISH_S,
    ),
    Row(
        "perplexity",
        "Perplexity",
        "Kimi-K2 fp8 (blocks 64 x 64); 256 -> 128 GPUs as 4 engines TP 32 / EP 32 "
        "(engine layout assumed: the seed's)",
        "kimi-k2-full",
        ("tp=32,ep=32,count=4",),
        senders=256,
        config={"quantization_config": {**FP8_128, "weight_block_size": [64, 64]}},
        measured_s=1.3,
        engine_finish_s=SEED_KIMI_FINISH_S,
    ),
    Row(
        "awex",
        "awex (RDMA)",
        "1T fp8, hardware not stated: taken as Kimi-K2 at the seed's layouts",
        "kimi-k2-full",
        KIMI_SEED_ENGINES,
        senders=256,
        stages=8,
        config={"quantization_config": {**FP8_128, "weight_block_size": [64, 64]}},
        measured_s=6.0,
        engine_finish_s=SEED_KIMI_FINISH_S,
        same_plan_as="seed-kimi",
    ),
    Row(
        "checkpoint-engine",
        "checkpoint-engine (broadcast)",
        "Kimi-K2 fp8 (blocks 128 x 128); 256 H20 as 16 engines TP 16 (vLLM, no EP); "
        "colocated parameter server, planned here as 256 separate senders",
        "kimi-k2-full",
        ("tp=16,count=16",),
        senders=256,
        measured_s=16.0,
        engine_finish_s=SEED_KIMI_FINISH_S,
    ),
]


def _model_folder(row: Row) -> str:
    from p2pweights.testing import model_config, write_model_dir

    if not row.config:
        return row.model
    config = {**model_config(row.model), **row.config}
    return str(write_model_dir(config, Path(tempfile.mkdtemp()) / row.key))


def _costed(plan: Any, staging: str, efficiency: float, finish_s: float) -> Any:
    from p2pweights.plan.cluster import plan_cluster

    return plan_cluster(
        plan.engines,
        num_senders=len(plan.senders),
        num_stages=plan.num_stages,
        broadcast_bytes_by_stage=plan.broadcast_bytes_by_stage,
        links=replace(plan.links, staging=staging),
        pipeline=replace(plan.pipeline, transport_efficiency=efficiency, engine_finish_s=finish_s),
    )


def run_row(row: Row, plans: dict[str, Any]) -> dict[str, Any]:
    from p2pweights.plan.cost import NIXL_VS_NCCL
    from p2pweights.planner import build_cluster_plan, parse_engine_spec

    started = time.perf_counter()
    plan = plans.get(row.same_plan_as or "")
    if plan is None:
        plan = build_cluster_plan(
            _model_folder(row),
            [parse_engine_spec(text) for text in row.engines],
            num_senders=row.senders,
            num_stages=row.stages,
        )
    plans[row.key] = plan
    ranks = [rank.num_bytes for engine in plan.engines for rank in engine.ranks]
    predictions = {
        name: _costed(plan, staging, efficiency, finish).prediction.as_dict()
        for name, staging, efficiency, finish in (
            ("host", "host", 1.0, 0.0),
            ("device", "device", 1.0, 0.0),
            ("device_slow_transport", "device", NIXL_VS_NCCL, 0.0),
            ("device_with_engine", "device", 1.0, row.engine_finish_s),
        )
    }
    host_bound = plan.p2p_bound
    device_bound = _costed(plan, "device", 1.0, 0.0).p2p_bound
    return {
        "key": row.key,
        "system": row.system,
        "setup": row.setup,
        "engines": list(row.engines),
        "senders": row.senders,
        "stages": row.stages,
        "engine_gpus": len(ranks),
        "rank_bytes": {"max": max(ranks), "min": min(ranks)},
        "busiest_sender_bytes": max(s.load.write_bytes for s in plan.senders),
        "p2p_bytes": plan.p2p_bytes,
        "broadcast_bytes": plan.broadcast_bytes,
        "update_bytes": sum(plan.broadcast_bytes_by_stage),
        "bound_s": {
            "p2p": host_bound.seconds,
            "p2p_device_staging": device_bound.seconds,
            "broadcast": plan.broadcast_bound.seconds,
        },
        "busiest_link": {"p2p": host_bound.link, "broadcast": plan.broadcast_bound.link},
        "predicted": predictions,
        "engine_finish_s": row.engine_finish_s,
        "measured_s": row.measured_s,
        "measured_broadcast_s": row.measured_broadcast_s,
        "plan_s": time.perf_counter() - started,
    }


def _tb(num_bytes: float) -> str:
    return f"{num_bytes / 1e12:.2f} TB" if num_bytes >= 1e12 else f"{num_bytes / 1e9:.0f} GB"


def _label(r: dict[str, Any]) -> str:
    """System, model and engines, e.g. ``vLLM sharded_rdt: Qwen3-235B-A22B bf16 (tp=8)``."""
    return f"{r['system']}: {r['setup'].split(';')[0]} ({' + '.join(r['engines'])})"


def tables(results: list[dict[str, Any]]) -> str:
    lines = [
        "| row | setup | engine GPUs | bytes per rank (max) | p2p bytes | broadcast bytes "
        "| p2p bound s (busiest link) | broadcast bound s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['system']} | {r['setup']} | {r['engine_gpus']} "
            f"| {r['rank_bytes']['max'] / 1e9:.1f} GB | {_tb(r['p2p_bytes'])} "
            f"| {_tb(r['broadcast_bytes'])} "
            f"| {r['bound_s']['p2p']:.3f} ({r['busiest_link']['p2p']}) "
            f"| {r['bound_s']['broadcast']:.3f} |"
        )
    lines += [
        "",
        "**Measured (as published) against the bound at the same layout:**",
        "",
        "| system | measured s | bound s | measured / bound |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {_label(r)} | {r['measured_s']:.2f} "
            f"| {r['bound_s']['p2p']:.3f} | **{r['measured_s'] / r['bound_s']['p2p']:.1f}** |"
        )
        if r["measured_broadcast_s"] is not None:
            lines.append(
                f"| miles NCCL broadcast (seed): {r['setup'].split(';')[0]} "
                f"| {r['measured_broadcast_s']:.2f} | {r['bound_s']['broadcast']:.3f} (broadcast) "
                f"| **{r['measured_broadcast_s'] / r['bound_s']['broadcast']:.1f}** |"
            )
    lines += [
        "",
        "**Our predicted update against the bound (warm update; the parts are in the JSON):**",
        "",
        "| row | host staging s | / bound | device staging s | / bound | slowest part (device) "
        "| device, writes at 0.745 of the NIC | + engine finish s | / bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, bound = r["predicted"], r["bound_s"]["p2p"]
        host, device = p["host"], p["device"]
        slow, full = p["device_slow_transport"], p["device_with_engine"]
        part = (
            f"{device['slowest']}: load {device['load_s']:.2f}, write {device['write_s']:.2f}, "
            f"control {device['control_s']:.2f}"
        )
        lines.append(
            f"| {_label(r)} | {host['seconds']:.2f} "
            f"| **{host['seconds'] / bound:.2f}** | {device['seconds']:.2f} "
            f"| **{device['seconds'] / bound:.2f}** | {part} "
            f"| {slow['seconds']:.2f} ({slow['seconds'] / bound:.2f}) "
            f"| {full['seconds']:.2f} (+{r['engine_finish_s']:.3f}) "
            f"| {full['seconds'] / bound:.2f} |"
        )
    return "\n".join(lines)


def _write_doc(doc: Path, generated: str) -> None:
    begin, end = "<!-- plan_vs_field:begin -->", "<!-- plan_vs_field:end -->"
    text = doc.read_text() if doc.exists() else f"{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(f"{head}{begin}\n{generated}\n{end}{tail}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--doc", type=Path, default=Path("docs/plan-vs-field.md"))
    parser.add_argument("--only", nargs="*", default=None, help="row keys to run")
    parser.add_argument(
        "--from-json", action="store_true", help="rewrite the doc from --out, planning nothing"
    )


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.from_json:
        saved = json.loads(args.out.read_text())
        _write_doc(args.doc, _generated(saved["when"], saved["rows"]))
        return None
    import logging

    logging.basicConfig(level=logging.WARNING)
    plans: dict[str, Any] = {}
    results = []
    for row in ROWS:
        if args.only and row.key not in args.only:
            continue
        result = run_row(row, plans)
        results.append(result)
        print(json.dumps({k: result[k] for k in ("key", "bound_s", "plan_s")}), flush=True)
    if not args.only:
        _write_doc(args.doc, _generated(time.strftime("%Y-%m-%d %H:%M:%S"), results))
    print(tables(results))
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": os.getloadavg(),
        "rows": results,
    }


def _generated(when: str, results: list[dict[str, Any]]) -> str:
    command = "`.venv/bin/python benchmarks/replica.py plan-vs-field`"
    return f"Generated by {command} ({when}).\n\n{tables(results)}"
