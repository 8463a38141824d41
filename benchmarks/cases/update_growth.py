"""Growth: update time and trainer host memory as the model doubles and as engines double.

Model size: Qwen3 configs of ``qwen3-demo``'s shape with 4, 12, 28 and 60 layers
(0.26, 0.51, 1.01, 2.02 GB of bf16), one TP-1 engine. Engines: 1, 2 and 4 TP-1
engines of the 0.51 GB model. In every case the busiest link is the trainer's
(it sends every byte), so a cost linear in bytes per busiest link shows as update
seconds proportional to ``bytes written``.

Host memory: each case's trainer runs in a fresh process. Its baseline RSS is taken
once torch, sglang's Qwen3 module and p2pweights are imported and the HF tensors
(the trainer's own) exist; ``VmHWM`` is then reset and the peak over connect, the
first update (probe) and the warm updates is the memory the session added. The
target: at most 2 x buffer_bytes plus replica metadata, whatever the model size.

    .venv/bin/python benchmarks/update.py growth            # about 7 minutes here
    .venv/bin/python benchmarks/update.py growth --quick    # 0.26 / 0.51 GB, 1 / 2 engines
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from typing import Any

from harness import (
    GB,
    RESULTS,
    hf_bytes,
    machine,
    markdown_table,
    median,
    peak_rss_bytes,
    qwen3_config,
    reset_peak_rss,
    rss_bytes,
    write_doc_section,
)

NAME = "growth"
MiB = 2**20


def child(args: argparse.Namespace) -> None:
    """The trainer of one case: prints one JSON line with times and memory."""
    import torch  # noqa: F401
    from sglang.srt.models import qwen3  # noqa: F401 (imported before the baseline)

    from harness import hf_tensors
    from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig, Timeouts
    from p2pweights.sync_session import WeightSyncSession

    tensors = hf_tensors(args.model)
    baseline = rss_bytes()
    reset_peak_rss()
    transport = MooncakeConfig(protocol="tcp") if args.transport == "mooncake" else NixlConfig()
    config = SyncConfig(
        transport=transport, buffer_bytes=args.buffer, timeouts=Timeouts(transfer=300)
    )
    with WeightSyncSession(config) as session:
        session.connect(args.engines)
        after_connect = rss_bytes()
        first = session.update(tensors)
        warm = [session.update(tensors) for _ in range(args.repeats)]
        executor = (
            session._connection.executor
        )  # the two staging buffers (their size after any growth)
        buffer_bytes = 2 * executor.buffer_bytes if executor is not None else 0
        peak, after = peak_rss_bytes(), rss_bytes()
    print(
        json.dumps(
            {
                "bytes_written": first.bytes_written,
                "first_s": first.seconds,
                "warm_s": median([r.seconds for r in warm]),
                "warm_all_s": [r.seconds for r in warm],
                "warm_stages": {
                    k: median([r.stage_seconds.get(k, 0.0) for r in warm])
                    for k in warm[0].stage_seconds
                },
                "baseline_rss": baseline,
                "added_after_connect": after_connect - baseline,
                "added_peak": peak - baseline,
                "added_after": after - baseline,
                "two_buffers_bytes": buffer_bytes,
            }
        )
    )


def run_case(label: str, layers: int, num_engines: int, args: argparse.Namespace) -> dict[str, Any]:
    from p2pweights.local_engine import LocalEngine
    from p2pweights.testing import write_model_dir

    config = qwen3_config(layers)
    folder = write_model_dir(config, tempfile.mkdtemp(prefix=f"p2pweights-growth-{layers}-"))
    engines = [LocalEngine(folder, tp=1, transport=args.transport) for _ in range(num_engines)]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        command = [
            *args.entry,
            "--child",
            "--model",
            str(folder),
            "--transport",
            args.transport,
            "--buffer",
            args.buffer,
            "--repeats",
            str(args.repeats),
            "--engines",
            *[e.url for e in engines],
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"trainer of case {label} failed:\n{done.stderr[-3000:]}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for engine in engines:
            engine.stop()
    return {
        "case": label,
        "layers": layers,
        "num_engines": num_engines,
        "model_bytes": hf_bytes(config),
        **measured,
    }


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    rows = []
    for r in results:
        other = r["added_peak"] - r["two_buffers_bytes"]
        rows.append(
            [
                r["case"],
                f"{r['model_bytes'] / GB:.2f}",
                r["num_engines"],
                f"{r['bytes_written'] / GB:.2f}",
                f"{r['warm_s']:.3f}",
                f"{r['bytes_written'] / r['warm_s'] / GB:.2f}",
                f"{r['warm_s'] / (r['bytes_written'] / GB):.3f}",
                f"{r['two_buffers_bytes'] / MiB:.0f}",
                f"{r['added_peak'] / MiB:.0f}",
                f"{other / MiB:.0f}",
                "met" if other <= meta["metadata_allowance_bytes"] else "MISSED",
            ]
        )
    table = markdown_table(
        [
            "case",
            "model GB",
            "engines",
            "GB on busiest link",
            "warm update s",
            "GB/s",
            "s per GB",
            "2 x buffer MiB",
            "added peak RSS MiB",
            "added - 2 buffers MiB",
            f"<= 2 x buffer + {meta['metadata_allowance_bytes'] / MiB:.0f} MiB",
        ],
        rows,
    )
    return (
        f"Command: `{meta['command']}`; {meta['transport']}, staging buffers "
        f"{meta['buffer']}; update seconds are medians of {meta['repeats']} warm updates; "
        f"machine {meta['machine_before']['cpus']} cores, load average "
        f"{meta['machine_before']['loadavg_1_5_15']} before and "
        f"{meta['machine_after']['loadavg_1_5_15']} after ({meta['machine_before']['time']}, "
        f"{meta['wall_s']:.0f} s). Linear fit of warm seconds on GB written: "
        f"{meta['fit']['slope_s_per_gb']:.3f} s/GB + {meta['fit']['intercept_s']:.3f} s "
        f"(R^2 {meta['fit']['r2']:.3f}).\n\n{table}\n\n"
        f"Figure: `benchmarks/results/{NAME}.png` (written by the run, not kept in git)."
    )


def fit(results: list[dict[str, Any]]) -> dict[str, float]:
    xs = [r["bytes_written"] / GB for r in results]
    ys = [r["warm_s"] for r in results]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope_s_per_gb": slope, "intercept_s": intercept, "r2": 1 - ss_res / ss_tot}


def plot(results: list[dict[str, Any]], line: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, marker in (("size", "o"), ("engines", "s")):
        chosen = [r for r in results if r["case"].startswith(kind)]
        left.plot(
            [r["bytes_written"] / GB for r in chosen],
            [r["warm_s"] for r in chosen],
            marker,
            label=f"doubling {kind}",
        )
        right.plot(
            [r["model_bytes"] * r["num_engines"] / GB for r in chosen],
            [r["added_peak"] / MiB for r in chosen],
            marker + "-",
            label=f"added peak RSS, doubling {kind}",
        )
    top = max(r["bytes_written"] for r in results) / GB
    left.plot(
        [0, top],
        [line["intercept_s"], line["intercept_s"] + line["slope_s_per_gb"] * top],
        "k--",
        lw=1,
        label="linear fit",
    )
    left.set_xlabel("GB written on the busiest link")
    left.set_ylabel("warm update seconds")
    left.legend()
    right.plot(
        [0, top], [results[0]["two_buffers_bytes"] / MiB] * 2, "k--", lw=1, label="2 x buffer"
    )
    right.set_xlabel("GB written per update")
    right.set_ylabel("MiB above baseline (trainer)")
    right.set_ylim(0, 1.25 * max(r["added_peak"] for r in results) / MiB)
    right.legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / f"{NAME}.png", dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    parser.add_argument("--buffer", default="256MiB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument(
        "--metadata-allowance-mib",
        type=float,
        default=128,
        help="what 'replica metadata' may add on top of the two buffers",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="+", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.child:
        child(args)
        return None
    command = args.command
    sizes, engine_counts = ((4, 12), (1, 2)) if args.quick else ((4, 12, 28, 60), (1, 2, 4))
    before, started = machine(), time.perf_counter()
    results = [run_case(f"size {layers} layers", layers, 1, args) for layers in sizes]
    for count in engine_counts:
        if count == 1:
            reused = next(r for r in results if r["layers"] == 12)
            results.append({**reused, "case": "engines 1"})
        else:
            results.append(run_case(f"engines {count}", 12, count, args))
    line = fit(results)
    meta = {
        "command": command,
        "transport": args.transport,
        "buffer": args.buffer,
        "repeats": args.repeats,
        "metadata_allowance_bytes": int(args.metadata_allowance_mib * MiB),
        "machine_before": before,
        "machine_after": machine(),
        "wall_s": time.perf_counter() - started,
        "fit": line,
    }
    text = report(results, meta)
    if not args.no_doc:  # the figure belongs to the doc's section: both or neither
        plot(results, line)
        write_doc_section(NAME, text)
    print(text)
    return {"meta": meta, "results": results}
