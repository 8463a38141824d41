"""The Triton kernel behind ``lanes_kernel`` (imported only where Triton is)."""

# mypy: ignore-errors
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def region_lanes(
    addresses,
    sizes,
    chunk_region,
    chunk_start,
    partial,
    LANES: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """The lane sums of one chunk (up to ``BLOCKS`` x ``BLOCK`` words) of one region per
    program, into ``partial[program + 1]`` (grid: every chunk).

    ``addresses``: each region's byte address (8-aligned); ``sizes``: its length in bytes;
    ``chunk_region`` / ``chunk_start``: each chunk's region and first word (a multiple of
    ``BLOCK``, itself a multiple of ``LANES``, so word ``i`` of the region is in lane
    ``i % LANES`` here too). Whole blocks are read unmasked; the region's last block, once,
    masked: the word holding the region's last bytes is read whole and the bytes past the
    end are zeroed (the digest's zero-padded tail; the read stays in that aligned word, so
    in the same page)."""
    pid = tl.program_id(0)
    region = tl.load(chunk_region + pid)
    start = tl.load(chunk_start + pid)
    num_bytes = tl.load(sizes + region)
    base = (tl.load(addresses + region) + start * 8).to(tl.pointer_type(tl.int64))
    whole = num_bytes // 8 - start  # whole words from the chunk's first
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
    tl.store(partial + (pid + 1) * LANES + tl.arange(0, LANES), lanes)
