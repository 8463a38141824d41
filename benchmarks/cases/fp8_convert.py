"""Cost of the sender-side fp8 conversion: block quantization of bf16 weights.

An update to a block-fp8 engine quantizes each weight the engine holds in fp8 on the
tensor's own device (``convert.fp8_block.quantize``) before the loaders run. This
measures that step alone, in GB/s of bf16 input, for the block sizes and scale
formats of the DeepSeek-V3 / Kimi-K2 style checkpoints, on the CPU and, where there
is one, the GPU, where torch's several-pass math and the one-pass Triton kernel
(``source/fp8_fused.py``) run side by side and their bytes are compared; and, for
scale, a bf16 -> bf16 copy of the same bytes (what staging a bf16 engine's weight
costs at least). Medians of ``--repeats`` after a warm-up.

On a GPU it also quantizes ``--batch`` separate weights of each shape (a layer's
experts) the ways an update can: one call per weight, one launch for all
(``quantize_many``), and one launch for the first 1/16 of each weight's block rows (what
a TP-16 rank's loaders read), each queued whole before one wait; per weight, the wall time and
the host time until the calls returned, and whether the bytes are equal.

    .venv/bin/python benchmarks/fp8.py convert [--shapes 7168x2048 16x2048x7168] [--out F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from harness import measure
from p2pweights.source import fp8_fused
from p2pweights.source.fp8_block import BlockFp8Format, quantize, quantize_many


def _median_seconds(step, repeats: int, device: torch.device) -> float:
    """Median seconds of ``repeats`` steps after one warm-up, the device synchronized."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return measure(step, repeats, sync=sync).median


def _torch_quantizer(weight: torch.Tensor, fmt: BlockFp8Format) -> tuple[torch.Tensor, ...]:
    os.environ["P2PWEIGHTS_FUSED_FP8"] = "0"
    try:
        return quantize(weight, fmt)
    finally:
        del os.environ["P2PWEIGHTS_FUSED_FP8"]


def _same_bytes(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["7168x2048"],
        help="weights to quantize, e.g. 7168x2048 (an expert) 16x2048x7168 (a stack)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--back-to-back", type=int, default=16, help="fused calls queued before one wait"
    )
    parser.add_argument("--devices", nargs="+", default=None, help="default: cpu and cuda")
    parser.add_argument(
        "--batch", type=int, default=64, help="separate weights per shape for the batch rows"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for shape_text in args.shapes:
        shape = tuple(int(n) for n in shape_text.split("x"))
        for device in map(torch.device, names):
            weight = (torch.randn(shape, device=device) * 0.02).bfloat16()
            out = torch.empty_like(weight)
            gb = weight.nbytes / 1e9
            copy_s = _median_seconds(
                lambda out=out, weight=weight: out.copy_(weight), args.repeats, device
            )
            row = {"shape": shape_text, "device": str(device), "case": "bf16 copy"}
            rows.append(row | {"gb_per_s": gb / copy_s})
            for block in ((128, 128), (64, 64)):
                for ue8m0 in (False, True):
                    fmt = BlockFp8Format(block, ue8m0=ue8m0)
                    case = f"{block[0]}x{block[1]}{' ue8m0' if ue8m0 else ''}"
                    torch_s = _median_seconds(
                        lambda fmt=fmt, weight=weight: _torch_quantizer(weight, fmt),
                        args.repeats,
                        device,
                    )
                    row = {"shape": shape_text, "device": str(device), "case": f"torch {case}"}
                    rows.append(row | {"gb_per_s": gb / torch_s, "of_copy": copy_s / torch_s})
                    if not fp8_fused.available(weight):
                        continue
                    fused_s = _median_seconds(
                        lambda fmt=fmt, weight=weight: quantize(weight, fmt), args.repeats, device
                    )
                    equal = _same_bytes(quantize(weight, fmt), _torch_quantizer(weight, fmt))
                    # as in an update: many weights queued one after another, one wait
                    stream_s = (
                        _median_seconds(
                            lambda fmt=fmt, weight=weight: [
                                quantize(weight, fmt) for _ in range(args.back_to_back)
                            ],
                            args.repeats,
                            device,
                        )
                        / args.back_to_back
                    )
                    rows.append(
                        row
                        | {
                            "case": f"fused {case}",
                            "gb_per_s": gb / fused_s,
                            "of_copy": copy_s / fused_s,
                            "back_to_back_of_copy": copy_s / stream_s,
                            "bit_equal_to_torch": equal,
                        }
                    )
            del weight, out
            if device.type == "cuda":
                rows += _batch_rows(shape_text, shape, device, args.batch, args.repeats)
    print(f"load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
    print("| shape | device | step | GB/s of bf16 input | of a copy | back to back | bit-equal |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['shape']} | {row['device']} | {row['case']} | {row['gb_per_s']:.1f} | "
            f"{row.get('of_copy', 1.0):.2f} | {row.get('back_to_back_of_copy', '')} | "
            f"{row.get('bit_equal_to_torch', '')} |"
        )
    batches = [row for row in rows if "us_per_weight" in row]
    print("| shape | weights | how | us per weight | host us per weight | GB/s | bit-equal |")
    print("|---|---|---|---|---|---|---|")
    for row in batches:
        print(
            f"| {row['shape']} | {row['weights']} | {row['case']} | {row['us_per_weight']:.1f} | "
            f"{row['host_us_per_weight']:.1f} | {row['gb_per_s']:.0f} | "
            f"{row.get('bit_equal_to_alone', '')} |"
        )
    options = {k: v for k, v in vars(args).items() if k not in ("entry", "command")}
    return {"args": options | {"out": str(args.out)}, "rows": rows}


def _batch_rows(
    shape_text: str, shape: tuple[int, ...], device: torch.device, count: int, repeats: int
) -> list[dict[str, object]]:
    """``count`` separate weights of ``shape``: one fused call each, then one launch."""
    weights = [(torch.randn(shape, device=device) * 0.02).bfloat16() for _ in range(count)]
    gb = sum(w.nbytes for w in weights) / 1e9
    fmt = BlockFp8Format((128, 128))
    grid_rows = -(-shape[-2] // 128)
    one_in_16 = [(0, max(1, grid_rows // 16), 0, -(-shape[-1] // 128))] * count
    ways = {
        "one call per weight": lambda: [quantize(w, fmt) for w in weights],
        "one launch (quantize_many)": lambda: quantize_many(weights, fmt),
        "one launch, 1/16 of the block rows (a TP-16 rank's)": lambda: quantize_many(
            weights, fmt, one_in_16
        ),
    }
    rows: list[dict[str, object]] = []
    for case, step in ways.items():
        wall = _median_seconds(step, repeats, device)
        host = []
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            step()
            host.append(time.perf_counter() - started)
            torch.cuda.synchronize(device)
        rows.append(
            {
                "shape": shape_text,
                "device": str(device),
                "weights": count,
                "case": case,
                "us_per_weight": wall / count * 1e6,
                "host_us_per_weight": statistics.median(host) / count * 1e6,
                "gb_per_s": gb / wall,
            }
        )
    alone, batched = ways["one call per weight"](), ways["one launch (quantize_many)"]()
    rows[1]["bit_equal_to_alone"] = all(
        _same_bytes(a, b) for a, b in zip(alone, batched, strict=True)
    )
    return rows
