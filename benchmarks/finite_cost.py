"""The NaN / Inf input check's cost (SyncConfig.verify_finite_inputs): the check alone over
a model's bf16 tensors, then updates of one local engine (Mooncake over TCP loopback) with
the check off and on, alternating session by session (a session's config is fixed; the
first update of each session probes and is left out)::

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/finite_cost.py qwen3-demo 3

Measured on the 2-core CPU machine (December 2026), qwen3-demo (383 MB of bf16): the
check alone 96 ms (4.0 GB/s on one thread); update median 1.171 s off, 1.387 s on
(check_inputs 0.157 s), +18.4 %; pause 0.950 / 0.939 s (the check runs before the
engines pause). benchmarks/results/finite_cost.txt holds that run's output.
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import hf_tensors, named_config
from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
from p2pweights.local_engine import LocalEngine
from p2pweights.source.finite import check_finite


def main(model: str, rounds: int) -> None:
    config = named_config(model)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    tensors = hf_tensors(config)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    times = []
    for _ in range(5):  # the check alone, as update() runs it: one pass over every tensor
        started = time.perf_counter()
        for name, tensor in tensors:
            check_finite(name, tensor)
        times.append(time.perf_counter() - started)
    check_s = statistics.median(times)
    print(
        f"{model}: {nbytes / 1e6:.1f} MB; check alone {check_s * 1e3:.1f} ms "
        f"({nbytes / check_s / 1e9:.2f} GB/s, {torch.get_num_threads()} threads)"
    )
    out: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
    with LocalEngine(folder, tp=1, seed=0, startup_timeout_s=900) as engine:
        for round_ in range(rounds):
            for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                sync = SyncConfig(
                    transport=MooncakeConfig(protocol="tcp"),
                    verify_finite_inputs=mode == "on",
                    buffer_bytes="256MiB",
                )
                with WeightSyncSession(sync) as session:
                    session.connect([engine.url])
                    for index in range(4):
                        report = session.update(tensors)
                        if index:  # the first probes
                            check = report.stage_seconds.get("check_inputs", 0.0)
                            paused = max(report.paused_s.values())
                            out[mode].append((report.seconds, check, paused))
    for mode, rows in out.items():
        update, check, paused = (statistics.median(r[i] for r in rows) for i in range(3))
        print(
            f"{mode} update median {update:.4f} s check_inputs median {check:.4f} s "
            f"pause median {paused:.4f} s n={len(rows)}"
        )
    on, off = (statistics.median(r[0] for r in out[mode]) for mode in ("on", "off"))
    print(
        f"cost: {100 * (on - off) / off:+.1f} % of the update "
        f"(check alone {100 * check_s / off:.1f} %)"
    )


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "qwen3-demo",
        int(sys.argv[2]) if len(sys.argv) > 2 else 3,
    )
