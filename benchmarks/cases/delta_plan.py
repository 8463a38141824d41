"""The seed's Kimi-K2 row of docs/plan-vs-field.md as full and as delta updates.

The plan is built once (replicas on meta, as ``benchmarks/replica.py plan-vs-field`` does), then
costed as a full update and as deltas at each ``--fractions`` share of the engines'
values changed (``plan_cluster(delta_fraction=...)``), with host and device staging.

    .venv/bin/python benchmarks/delta.py plan           # results/delta_plan.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from cases.replica_plan_vs_field import ROWS, _model_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--row", default="seed-kimi")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.10])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from p2pweights.plan.cluster import plan_cluster
    from p2pweights.planner import build_cluster_plan, parse_engine_spec

    (row,) = [r for r in ROWS if r.key == args.row]
    plan = build_cluster_plan(
        _model_folder(row),
        [parse_engine_spec(text) for text in row.engines],
        num_senders=row.senders,
        num_stages=row.stages,
    )
    results: dict[str, Any] = {"row": row.key, "setup": row.setup, "costed": []}
    for staging in ("host", "device"):
        for fraction in args.fractions:
            costed = plan_cluster(
                plan.engines,
                num_senders=len(plan.senders),
                num_stages=plan.num_stages,
                broadcast_bytes_by_stage=plan.broadcast_bytes_by_stage,
                links=replace(plan.links, staging=staging),
                pipeline=replace(plan.pipeline, engine_finish_s=row.engine_finish_s),
                delta_fraction=fraction,
            )
            assert costed.delta is not None
            entry = {
                "staging": staging,
                "fraction": fraction,
                "full": {
                    "p2p_bytes": costed.p2p_bytes,
                    "bound_s": costed.p2p_bound.seconds,
                    "busiest_link": costed.p2p_bound.link,
                    "predicted": costed.prediction.as_dict(),
                },
                "delta": costed.delta.to_json(),
            }
            results["costed"].append(entry)
            d = costed.delta
            print(
                f"{staging} staging, {100 * fraction:g} % changed: bytes "
                f"{costed.p2p_bytes / 1e12:.2f} -> {d.p2p_bytes / 1e12:.3f} TB, bound "
                f"{costed.p2p_bound.seconds:.3f} -> {d.p2p_bound.seconds:.3f} s "
                f"({d.p2p_bound.link}), predicted {costed.prediction.seconds:.3f} -> "
                f"{d.prediction.seconds:.3f} s (load {d.prediction.load_s:.3f}, write "
                f"{d.prediction.write_s:.3f}, engine {d.prediction.engine_s:.3f})",
                flush=True,
            )
    return results
