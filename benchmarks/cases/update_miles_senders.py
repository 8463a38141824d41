"""What it costs when every miles trainer rank sends, against miles' rule (the first
``sum(engine_gpu_counts)`` ranks of a stage send), through miles' own updater.

Runs tests/integration/test_miles_main_protocol.py's trainer ranks (miles' protocol.py /
updater.py / session.py from tests/fixtures/miles-protocol) into local engines over
Mooncake TCP on this host, both ways, and prints each update's wall time on every rank
(miles' ``update_weights``), the slowest rank's, and how many tensors each rank
converted. The first update of each run includes p2pweights' first-update planning.

    .venv/bin/python benchmarks/update.py miles-senders --world 4 --engines 1 --updates 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness import ROOT
from p2pweights.local_engine import LocalEngine
from p2pweights.testing import write_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--engines", type=int, nargs="+", default=[1], help="TP sizes")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--folder", default="/tmp/p2pweights-miles-senders")


def run(options: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import test_miles_main_protocol as driven

    out: dict[str, Any] = {"world": options.world, "engines_tp": options.engines, "rules": {}}
    folder = write_model_dir(options.model, Path(options.folder))
    engines = [LocalEngine(folder, tp=tp, transport="mooncake", seed=0) for tp in options.engines]
    for engine in engines:
        engine.start()
    for engine in engines:
        engine.wait_ready()
    try:
        for label, counts in (("miles' rule", True), ("every rank", False)):
            rows = []

            def record(index, results, rows=rows):
                walls = [r[2][3] for r in results]
                senders = sum(r[2][1] for r in results)
                converted = sum(r[4] for r in results)
                rows.append((index, senders, max(walls), walls, converted))

            seeds = [100 + i for i in range(options.updates)]
            driven._run(
                folder,
                engines,
                world=options.world,
                num_stages=1,
                seeds=seeds,
                check=record,
                counts=counts,
            )
            out["rules"][label] = [
                {"senders": n, "slowest_s": slowest, "rank_s": walls, "converted": converted}
                for _, n, slowest, walls, converted in rows
            ]
            print(f"{label}: world {options.world}, engines TP {options.engines}")
            for index, senders, slowest, walls, converted in rows:
                ranks = " ".join(f"{w:.3f}" for w in walls)
                print(
                    f"  update {index + 1}: {senders} senders, slowest {slowest:.3f} s "
                    f"(ranks: {ranks}), tensors converted {converted}"
                )
    finally:
        for engine in engines:
            engine.stop()
    return out
