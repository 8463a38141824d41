"""The NaN / Inf input check (``source.finite.check_finite``) on one GPU: GB/s over 8 GB of
bf16 and of fp8 in tensors of a 4096 x 14336 MLP matrix's size, and what that is of
writing the same bytes at 50 GB/s (one RDMA NIC) and 300 GB/s (NVLink device copies)::

    python3 benchmarks/verify.py finite-gpu
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from harness import GB
from p2pweights.source.finite import check_finite

SHAPE = (4096, 14336)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gb", type=float, default=8.0, help="bytes checked per dtype")
    parser.add_argument("--repeats", type=int, default=4, help="the first warms up")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda:0")
    results: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        count = max(1, int(args.gb * GB // (SHAPE[0] * SHAPE[1] * dtype.itemsize)))
        tensors = [torch.randn(SHAPE, device=device).to(dtype) for _ in range(count)]
        num_bytes = sum(t.numel() * t.element_size() for t in tensors)
        seconds = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for index, tensor in enumerate(tensors):
                check_finite(f"t{index}", tensor)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        best = min(seconds[1:] or seconds)
        results[str(dtype).removeprefix("torch.")] = {
            "bytes": num_bytes,
            "best_s": round(best, 6),
            "gb_per_s": round(num_bytes / best / GB, 1),
            "of_writing_at_50_gb_per_s": round(best / (num_bytes / 50e9), 4),
            "of_writing_at_300_gb_per_s": round(best / (num_bytes / 300e9), 4),
        }
        print(dtype, results[str(dtype).removeprefix("torch.")])
        del tensors
    return {"shape": list(SHAPE), "dtypes": results}
