"""How the digest kernel's shape was chosen, and what seeing order costs (GPU hosts).

Times the one-launch kernel (``wire/_lanes_triton.py``, "weighted": the digest's
plain and row-weighted lane sums) at a few shapes, beside "plain", the same kernel
without the weighted sums (the digest before it saw reordered bytes: one add per word
instead of two). The form whose first loop is bounded by the loaded block count (before
Triton 3.6's interpreter needed a constant trip count) was timed beside them once, in
``results/digest_kernel_variants_h200.json``, and dropped here. On the
parameters of a Qwen3-8B-shaped TP-1 rank (291 tensors, 16.4 GB) and of the 1 GB
``qwen3-1g`` shape (227 tensors), against torch's launches per region
(``P2PWEIGHTS_DIGEST_KERNEL=0``), side by side in one run; every variant's sums are
compared with torch's first. Times are medians of 5 after a warm-up, the device
synchronized around each (the kernel and its few torch ops, no hashing).

    PYTHONPATH=src python3 benchmarks/verify.py digest-kernel [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

import harness
from p2pweights.wire import _lanes_triton, digest

LANES = digest.LANES


@triton.jit
def plain_lanes(
    addresses,
    sizes,
    chunk_region,
    chunk_start,
    partial,
    LANES: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """The plain lane sums alone (the digest's first definition), written like the
    library's kernel; its second ``LANES`` columns are left zero."""
    pid = tl.program_id(0)
    region = tl.load(chunk_region + pid)
    start = tl.load(chunk_start + pid)
    num_bytes = tl.load(sizes + region)
    base = (tl.load(addresses + region) + start * 8).to(tl.pointer_type(tl.int64))
    whole = num_bytes // 8 - start
    full = tl.minimum(whole // BLOCK, BLOCKS).to(tl.int32)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for block in range(0, full):
        acc += tl.load(base + block * BLOCK + offsets)
    if full < BLOCKS:
        at = full * BLOCK + offsets
        words = (num_bytes + 7) // 8 - start
        tail = (tl.full([], 1, tl.int64) << ((num_bytes % 8) * 8)) - 1
        word = tl.load(base + at, mask=at < words, other=0)
        acc += tl.where(at == whole, word & tail, word)
    lanes = tl.sum(tl.reshape(acc, (BLOCK // LANES, LANES)), axis=0)
    tl.store(partial + (pid + 1) * 2 * LANES + tl.arange(0, LANES), lanes)


KERNELS = {"plain": plain_lanes, "weighted": _lanes_triton.region_lanes}
VARIANTS = [  # (kernel, BLOCK words, BLOCKS, num_warps, num_stages)
    ("plain", 2048, 256, 8, None),
    ("weighted", 2048, 256, 8, None),
    ("weighted", 2048, 128, 8, None),
    ("weighted", 4096, 128, 16, None),
    ("weighted", 1024, 256, 4, None),
    ("weighted", 2048, 512, 8, None),
    ("weighted", 2048, 1024, 8, None),
]


def run_variant(regions, kernel, block, blocks, warps, stages):
    device = regions[0].device
    chunk = block * blocks
    sizes = [r.numel() for r in regions]
    counts = torch.tensor([-(-((n + 7) // 8) // chunk) for n in sizes])
    ends = counts.cumsum(0)
    chunk_region = torch.repeat_interleave(torch.arange(len(sizes)), counts).int().to(device)
    first = torch.repeat_interleave(ends - counts, counts)
    chunk_start = ((torch.arange(int(ends[-1])) - first) * chunk).to(device)
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(device)
    sizes_t = torch.tensor(sizes, dtype=torch.int64, device=device)
    extra = {} if stages is None else {"num_stages": stages}

    def run():
        addresses = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64).to(device)
        partial = torch.zeros(len(chunk_region) + 1, 2 * LANES, dtype=torch.int64, device=device)
        KERNELS[kernel][(len(chunk_region),)](
            addresses,
            sizes_t,
            chunk_region,
            chunk_start,
            partial,
            LANES=LANES,
            BLOCK=block,
            BLOCKS=blocks,
            num_warps=warps,
            **extra,
        )
        sums = partial.cumsum(0)
        return sums[bounds[1:]] - sums[bounds[:-1]]

    return run


def timed(call, repeats=5):
    """Median seconds of ``repeats`` calls after one warm-up, the device synchronized."""
    return harness.measure(call, repeats, sync=harness.cuda_sync).median


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options beyond ``--out``."""


def run(args: argparse.Namespace) -> dict[str, object]:
    from cases import verify_digest as bench

    result: dict[str, object] = {"device": torch.cuda.get_device_name()}
    for shape in ("qwen3-8b", "qwen3-1g"):
        print(shape, flush=True)
        result[shape] = measure(bench.rank_params(shape, None, "cuda"))
        torch.cuda.empty_cache()
    print(json.dumps(result, indent=2))
    return result


def measure(params: dict[str, torch.Tensor]) -> dict[str, object]:
    """Every variant on one rank's parameters; torch's launches per region first."""
    regions = [t.view(-1).view(torch.uint8) for t in params.values()]
    num_bytes = sum(r.numel() for r in regions)
    os.environ["P2PWEIGHTS_DIGEST_KERNEL"] = "0"
    expected = torch.stack([digest.lane_sums({"r": r})["r"].rows[0] for r in regions])
    torch_s = timed(lambda: digest.lane_sums(dict(enumerate(regions))))
    rows = {"torch per region": {"ms": torch_s * 1e3, "gb_s": num_bytes / torch_s / 1e9}}
    for kernel, block, blocks, warps, stages in VARIANTS:
        name = f"{kernel} block={block} blocks={blocks} warps={warps} stages={stages}"
        try:
            run = run_variant(regions, kernel, block, blocks, warps, stages)
            got = run()
            columns = LANES if kernel == "plain" else 2 * LANES
            same = torch.equal(got[:, :columns], expected[:, :columns])
            seconds = timed(run)
            rows[name] = {"ms": seconds * 1e3, "gb_s": num_bytes / seconds / 1e9, "same": same}
        except Exception as exc:  # a variant that does not compile is a result too
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(name, rows[name], flush=True)
    flat = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    copy_s = timed(lambda: flat.copy_(torch.cat(regions)))
    return {
        "bytes": num_bytes,
        "tensors": len(regions),
        "variants": rows,
        "cat_copy_ms": copy_s * 1e3,
    }
