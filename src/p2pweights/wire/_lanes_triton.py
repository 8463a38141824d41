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
    """The sums of one chunk (up to ``BLOCKS`` x ``BLOCK`` words) of one region per
    program, into ``partial[program + 1]``: ``LANES`` plain, then ``LANES`` weighted by the
    word's row in the region plus one (grid: every chunk).

    ``addresses``: each region's byte address (8-aligned); ``sizes``: its length in bytes;
    ``chunk_region`` / ``chunk_start``: each chunk's region and first word (a multiple of
    ``BLOCK``, itself a multiple of ``LANES``, so word ``i`` of the region is in lane
    ``i % LANES`` here too). Whole blocks are read unmasked; the region's last block, once,
    masked: the word holding the region's last bytes is read whole and the bytes past the
    end are zeroed (the digest's zero-padded tail; the read stays in that aligned word, so
    in the same page).

    The weights cost adds, not multiplies, per word: ``acc`` keeps the running sum of the
    blocks read and ``runs`` the sum of those running sums, so after ``n`` blocks
    ``n * acc - runs`` is each position's sum of ``block * word``; the word at position
    ``p`` of block ``b`` is in row ``start / LANES + b * BLOCK / LANES + p // LANES``."""
    pid = tl.program_id(0)
    region = tl.load(chunk_region + pid)
    start = tl.load(chunk_start + pid)
    num_bytes = tl.load(sizes + region)
    base = (tl.load(addresses + region) + start * 8).to(tl.pointer_type(tl.int64))
    whole = num_bytes // 8 - start  # whole words from the chunk's first
    full = tl.minimum(whole // BLOCK, BLOCKS).to(tl.int32)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    runs = tl.zeros((BLOCK,), dtype=tl.int64)
    # a constant trip count with the bound tested inside (not ``range(0, full)``): Triton
    # 3.6's interpreter cannot take a loaded value as a loop bound under numpy 2.4+
    for block in range(0, BLOCKS):
        if block < full:
            acc += tl.load(base + block * BLOCK + offsets)
            runs += acc
    num_blocks = full.to(tl.int64)
    if full < BLOCKS:
        at = full * BLOCK + offsets
        words = (num_bytes + 7) // 8 - start
        tail = (tl.full([], 1, tl.int64) << ((num_bytes % 8) * 8)) - 1
        word = tl.load(base + at, mask=at < words, other=0)
        acc += tl.where(at == whole, word & tail, word)
        runs += acc
        num_blocks += 1
    by_block = num_blocks * acc - runs  # per position: sum over blocks of block * word
    row_in_block = (offsets // LANES + 1).to(tl.int64)
    weighted = (BLOCK // LANES) * by_block + row_in_block * acc
    plain = tl.sum(tl.reshape(acc, (BLOCK // LANES, LANES)), axis=0)
    weighted = tl.sum(tl.reshape(weighted, (BLOCK // LANES, LANES)), axis=0)
    weighted += (start // LANES) * plain  # the chunk's rows counted from the region's first
    out = partial + (pid + 1) * 2 * LANES + tl.arange(0, LANES)
    tl.store(out, plain)
    tl.store(out + LANES, weighted)
