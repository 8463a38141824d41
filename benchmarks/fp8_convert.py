"""Cost of the sender-side fp8 conversion: block quantization of bf16 weights.

An update to a block-fp8 engine quantizes each weight the engine holds in fp8 on the
tensor's own device (``convert.fp8_block.quantize``) before the loaders run. This
measures that step alone, in GB/s of bf16 input, for the block sizes and scale
formats of the DeepSeek-V3 / Kimi-K2 style checkpoints, on the CPU and, where there
is one, the GPU, where torch's several-pass math and the one-pass Triton kernel
(``source/fp8_fused.py``) run side by side and their bytes are compared; and, for
scale, a bf16 -> bf16 copy of the same bytes (what staging a bf16 engine's weight
costs at least). Medians of ``--repeats`` after a warm-up.

    .venv/bin/python benchmarks/fp8_convert.py [--shapes 7168x2048 16x2048x7168] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from p2pweights.source import fp8_fused
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
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
    print(f"load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
    print("| shape | device | step | GB/s of bf16 input | of a copy | back to back | bit-equal |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['shape']} | {row['device']} | {row['case']} | {row['gb_per_s']:.1f} | "
            f"{row.get('of_copy', 1.0):.2f} | {row.get('back_to_back_of_copy', '')} | "
            f"{row.get('bit_equal_to_torch', '')} |"
        )
    if args.out is not None:
        machine = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
        args.out.write_text(
            json.dumps(
                {"args": vars(args) | {"out": str(args.out)}, "machine": machine, "rows": rows},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
