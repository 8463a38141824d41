"""How the fused fp8 kernel's launch settings were chosen (GPU hosts).

For weight shapes of a DeepSeek-V3-style model, times the kernel of
``source/_fp8_triton.py`` under several ``num_warps`` and a two-pass variant that holds
a quarter of a block at a time (first pass: block maximum; second: re-read, scale,
cast), against a bf16 copy of the same weight:

* ``gpu``: GPU time alone, 16 launches captured in a CUDA graph and replayed;
* ``wall``: 16 calls of ``quantize_fused`` back to back, one wait (what an update does);
* ``cpu``: the 16 calls' host time alone (launch cost), no wait.

Every variant's bytes are compared with torch's quantizer.

    python3 benchmarks/fp8.py kernel [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import triton
import triton.language as tl

from p2pweights.source import _fp8_triton, fp8_fused
from p2pweights.source.fp8_block import BlockFp8Format, quantize

CALLS = 16


@triton.jit
def two_pass(
    w_ptr,
    q_ptr,
    scale_ptr,
    rows,
    cols,
    stride_m,
    stride_r,
    stride_c,
    BN: tl.constexpr,
    BK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    matrix = tl.program_id(0).to(tl.int64)
    block_row = tl.program_id(1)
    block_col = tl.program_id(2)
    c = block_col * BK + tl.arange(0, BK)
    cols_at = c[None, :].to(tl.int64)
    amax = tl.zeros((), dtype=tl.float32)
    for start in range(0, BN, CHUNK):
        r = block_row * BN + start + tl.arange(0, CHUNK)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        src = w_ptr + matrix * stride_m + r[:, None].to(tl.int64) * stride_r + cols_at * stride_c
        w = tl.load(src, mask=inside, other=0.0).to(tl.float32)
        part = tl.reduce(tl.abs(w), None, _fp8_triton._max_keeping_nan)
        amax = tl.maximum(amax, part, propagate_nan=tl.PropagateNan.ALL)
    amax = tl.maximum(amax, 1e-4, propagate_nan=tl.PropagateNan.ALL)
    scale = tl.math.div_rn(amax, 448.0)
    inverse = tl.math.div_rn(1.0, scale)
    for start in range(0, BN, CHUNK):
        r = block_row * BN + start + tl.arange(0, CHUNK)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        src = w_ptr + matrix * stride_m + r[:, None].to(tl.int64) * stride_r + cols_at * stride_c
        w = tl.load(src, mask=inside, other=0.0).to(tl.float32)
        x = tl.clamp(w * inverse, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        q = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        negative = x.to(tl.int32, bitcast=True) < 0
        q = tl.where(x != x, tl.where(negative, 0xFF, 0x7F).to(tl.uint8), q)
        dst = q_ptr + matrix * rows * cols + r[:, None].to(tl.int64) * cols + cols_at
        tl.store(dst, q, mask=inside)
    grid_cols = tl.cdiv(cols, BK)
    grid_rows = tl.cdiv(rows, BN)
    tl.store(scale_ptr + (matrix * grid_rows + block_row) * grid_cols + block_col, scale)


def _launcher(variant: str):
    def run(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = weight.shape
        m = weight.view(1, rows, cols)
        grid = (1, -(-rows // 128), -(-cols // 128))
        q = torch.empty((1, rows, cols), dtype=torch.float8_e4m3fn, device=weight.device)
        s = torch.empty(grid, dtype=torch.float32, device=weight.device)
        if variant.startswith("one-pass"):
            warps = int(variant.split("w")[-1])
            _fp8_triton.block_fp8[grid](
                m, q.view(torch.uint8), s, rows, cols, *m.stride(),
                BN=128, BK=128, PAD_N=128, PAD_K=128, UE8M0=False, num_warps=warps,
            )  # fmt: skip
        else:
            chunk, warps = (int(x) for x in variant.split(":")[1:])
            two_pass[grid](
                m, q.view(torch.uint8), s, rows, cols, *m.stride(),
                BN=128, BK=128, CHUNK=chunk, num_warps=warps,
            )  # fmt: skip
        return q.view(rows, cols), s.view(grid[1:])

    return run


def _median(step, repeats: int = 7) -> float:
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graph_time(step) -> float:
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            step()
    return _median(graph.replay) / CALLS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=["2048x7168", "7168x2048", "18432x7168"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    variants = ["one-pass w4", "one-pass w8", "one-pass w16", "two-pass:32:4", "two-pass:16:4"]
    rows = []
    fmt = BlockFp8Format((128, 128))
    for shape_text in args.shapes:
        shape = tuple(int(n) for n in shape_text.split("x"))
        weight = (torch.randn(shape, device="cuda") * 0.02).bfloat16()
        out = torch.empty_like(weight)
        copy_gpu = _graph_time(lambda out=out, weight=weight: out.copy_(weight))
        os.environ["P2PWEIGHTS_FUSED_FP8"] = "0"
        want = quantize(weight, fmt)
        del os.environ["P2PWEIGHTS_FUSED_FP8"]
        for variant in [*variants, "quantize_fused"]:
            run = _launcher(variant) if variant != "quantize_fused" else None

            def step(run=run, weight=weight):
                if run is None:
                    return fp8_fused.quantize_fused(weight, (128, 128), False)
                return run(weight)

            got = step()
            equal = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(got, want, strict=True)
            )
            gpu = _graph_time(step)
            wall = _median(lambda step=step: [step() for _ in range(CALLS)]) / CALLS
            t0 = time.perf_counter()
            for _ in range(CALLS):
                step()
            cpu = (time.perf_counter() - t0) / CALLS
            torch.cuda.synchronize()
            row = {
                "shape": shape_text,
                "variant": variant,
                "gpu_us": gpu * 1e6,
                "wall_us": wall * 1e6,
                "cpu_us": cpu * 1e6,
                "copy_gpu_us": copy_gpu * 1e6,
                "gpu_of_copy": copy_gpu / gpu,
                "wall_of_copy": copy_gpu / wall,
                "bit_equal": equal,
            }
            rows.append(row)
            print(
                f"{shape_text:>11} {variant:>15}: gpu {gpu * 1e6:7.1f} us ({copy_gpu / gpu:.2f} "
                f"of copy {copy_gpu * 1e6:.1f} us)  wall {wall * 1e6:7.1f} us "
                f"({copy_gpu / wall:.2f})  cpu {cpu * 1e6:6.1f} us  equal {equal}"
            )
    return {"gpu": torch.cuda.get_device_name(0), "rows": rows}
