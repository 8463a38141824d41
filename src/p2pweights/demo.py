"""The demo: two local engines, a trainer process, verified updates, one table.

Each update sends new HF weights (the first sends the weights the engines started
with, so the engines' own weight checker can compare snapshot and update), and
every engine rank is then checked bit-exactly: the engine's sglang checksums
against sglang's own ``load_weights`` of the same tensors into a real model of
that rank.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig, parse_bytes
from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import LocalEngine
from p2pweights.session import WeightSyncSession
from p2pweights.testing.synthetic import synthetic_weights, write_model_dir
from p2pweights.verify import verify_engine


def run_demo(
    *,
    model: str = "qwen3-demo",
    transport: str = "mooncake",
    engine_tps: list[int] | tuple[int, ...] = (2, 1),
    num_updates: int = 3,
    buffer_bytes: int | str = "256MiB",
) -> int:
    folder = write_model_dir(model, Path(tempfile.mkdtemp(prefix="p2pweights-demo-")))
    engines = [LocalEngine(folder, tp=tp, transport=transport, seed=0) for tp in engine_tps]
    print(f"starting {len(engines)} local engine(s) of {model} (TP {list(engine_tps)}) ...")
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        return _run_updates(folder, engines, transport, num_updates, buffer_bytes)
    finally:
        for engine in engines:
            engine.stop()


def _run_updates(
    folder: Path,
    engines: list[LocalEngine],
    transport: str,
    num_updates: int,
    buffer_bytes: int | str,
) -> int:
    config = SyncConfig(
        transport=MooncakeConfig(protocol="tcp") if transport == "mooncake" else NixlConfig(),
        buffer_bytes=parse_bytes(buffer_bytes),
        check_weight_update_equal=True,
    )
    rows = []
    with WeightSyncSession(config) as session:
        session.connect([e.url for e in engines])
        for step in range(num_updates):
            seed = 0 if step == 0 else 1000 + step  # the first update resends the start weights

            def weights(seed: int = seed) -> list[tuple[str, torch.Tensor]]:
                return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))

            report = session.update(weights())
            mismatches = {
                engine.url: verify_engine(EngineClient(engine.url), weights) for engine in engines
            }
            ok = all(not names for ranks in mismatches.values() for names in ranks.values())
            rows.append((report, ok, mismatches))
    _print_table(rows)
    return 0 if all(ok for _, ok, _ in rows) else 1


def _print_table(rows: list) -> None:
    print()
    print(f"{'version':>7} {'MB written':>10} {'ranks':>5} {'seconds':>8} {'GB/s':>6}  check")
    for report, ok, mismatches in rows:
        print(
            f"{report.version:>7} {report.bytes_written / 1e6:>10.1f} "
            f"{len(report.bytes_by_target):>5} {report.seconds:>8.3f} {report.gb_per_s:>6.2f}  "
            f"{'OK (bit-exact at every rank)' if ok else 'MISMATCH'}"
        )
        if not ok:
            for url, ranks in mismatches.items():
                for rank, names in ranks.items():
                    if names:
                        print(
                            f"        {url} rank {rank}: {len(names)} tensor(s) differ: {names[:4]}"
                        )
