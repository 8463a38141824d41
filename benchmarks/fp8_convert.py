"""Cost of the sender-side fp8 conversion: block quantization of bf16 weights.

An update to a block-fp8 engine quantizes each weight the engine holds in fp8 on the
tensor's own device (``convert.fp8_block.quantize``) before the loaders run. This
measures that step alone, in GB/s of bf16 input, for the block sizes and scale
formats of the DeepSeek-V3 / Kimi-K2 style checkpoints, on the CPU and, where there
is one, the GPU; and, for scale, a bf16 -> bf16 copy of the same bytes (what staging
a bf16 engine's weight costs at least). Medians of ``--repeats`` after a warm-up.

    .venv/bin/python benchmarks/fp8_convert.py [--rows 7168 --cols 2048] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from p2pweights.source.fp8_block import BlockFp8Format, quantize


def _median_seconds(step, repeats: int, device: torch.device) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=7168)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    rows = []
    for device in devices:
        weight = (torch.randn(args.rows, args.cols, device=device) * 0.02).bfloat16()
        out = torch.empty_like(weight)
        gb = weight.nbytes / 1e9
        copy_s = _median_seconds(
            lambda out=out, weight=weight: out.copy_(weight), args.repeats, device
        )
        rows.append({"device": str(device), "case": "bf16 copy", "gb_per_s": gb / copy_s})
        for block in ((128, 128), (64, 64)):
            for ue8m0 in (False, True):
                fmt = BlockFp8Format(block, ue8m0=ue8m0)
                seconds = _median_seconds(
                    lambda fmt=fmt, weight=weight: quantize(weight, fmt), args.repeats, device
                )
                case = f"quantize {block[0]}x{block[1]}{' ue8m0' if ue8m0 else ''}"
                rows.append({"device": str(device), "case": case, "gb_per_s": gb / seconds})
    print(
        f"weight {args.rows} x {args.cols} bf16 ({gb * 1e3:.1f} MB); load average "
        f"{os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}"
    )
    print("| device | step | GB/s of bf16 input |\n|---|---|---|")
    for row in rows:
        print(f"| {row['device']} | {row['case']} | {row['gb_per_s']:.2f} |")
    if args.out is not None:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
