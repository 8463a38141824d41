"""The Triton kernel behind ``gathered_copies`` (imported only where Triton is)."""

# mypy: ignore-errors
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gathered_copies(
    bases,
    meta,
    chunk_copy,
    chunk_start,
    like,
    BLOCK: tl.constexpr,
    FLAT: tl.constexpr,
):
    """One chunk of ``BLOCK`` units of one copy per program (grid: every chunk).

    ``bases``: the byte address of each owner (inputs, then destinations). ``meta``,
    eight int64 per copy: source owner, source byte offset, destination owner,
    destination byte offset, units, columns, source row stride, destination row stride
    (units; ``FLAT`` copies are one contiguous run and skip the row arithmetic). A unit
    is ``like``'s element type: the bytes move unchanged."""
    pid = tl.program_id(0)
    copy = tl.load(chunk_copy + pid).to(tl.int64)
    start = tl.load(chunk_start + pid)
    row = meta + copy * 8
    unit = tl.pointer_type(like.dtype.element_ty)
    src = (tl.load(bases + tl.load(row)) + tl.load(row + 1)).to(unit)
    dst = (tl.load(bases + tl.load(row + 2)) + tl.load(row + 3)).to(unit)
    count = tl.load(row + 4)
    at = start + tl.arange(0, BLOCK).to(tl.int64)
    inside = at < count
    if FLAT:
        src_at = at
        dst_at = at
    else:
        cols = tl.load(row + 5).to(tl.int32)
        r = at.to(tl.int32) // cols
        c = at.to(tl.int32) - r * cols
        src_at = r.to(tl.int64) * tl.load(row + 6) + c
        dst_at = r.to(tl.int64) * tl.load(row + 7) + c
    values = tl.load(src + src_at, mask=inside)
    tl.store(dst + dst_at, values, mask=inside)
