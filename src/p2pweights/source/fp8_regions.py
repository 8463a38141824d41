"""Which blocks of an fp8 weight a sender must quantize: those its targets' loaders read.

A TP rank of a block-fp8 engine reads a slice of each weight (a column-parallel
weight's rows, a row-parallel one's columns) and the matching part of its
``_scale_inv``; the sender quantizes whole HF tensors before the loaders narrow them.
Once a group's load is replayed (``replica/sglang/replay.py``), its recorded copies say
exactly which elements of each input were read. Blocks are quantized independently
(a block's bytes and scale depend on its own values), so quantizing only the blocks
that hold those elements gives the loaders the same bytes, for a fraction of the work
(1/TP of it for a TP-sliced weight).

``block_box`` turns the reads of one weight and its scale into one box of blocks, or
None when every block is read or a read is not a rectangle of the weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from p2pweights.source.fp8_fused import Box

__all__ = ["Read", "block_box"]

Read = tuple[int, tuple[int, ...], tuple[int, ...]]
"""A strided view read from an input: (element offset, shape, stride)."""


def block_box(
    shape: Sequence[int],
    block: tuple[int, int],
    weight_reads: Iterable[Read],
    scale_reads: Iterable[Read],
) -> Box | None:
    """The blocks ``(first row, end row, first column, end column)`` of a contiguous 2-D
    weight of ``shape`` that hold every element read from it, and every block whose
    scale was read; None if that is every block, or a read is not a rectangle."""
    if len(shape) != 2:
        return None
    rows, cols = shape
    bn, bk = block
    grid_rows, grid_cols = -(-rows // bn), -(-cols // bk)
    boxes = []
    for read in weight_reads:
        rect = _rectangle(read, cols)
        if rect is None:
            return None
        r0, r1, c0, c1 = rect
        boxes.append((r0 // bn, -(-r1 // bn), c0 // bk, -(-c1 // bk)))
    for read in scale_reads:
        rect = _rectangle(read, grid_cols)
        if rect is None:
            return None
        boxes.append(rect)
    boxes = [b for b in boxes if b[0] < b[1] and b[2] < b[3]]
    if not boxes:
        return None
    box = (
        min(b[0] for b in boxes),
        max(b[1] for b in boxes),
        min(b[2] for b in boxes),
        max(b[3] for b in boxes),
    )
    return None if box == (0, grid_rows, 0, grid_cols) else box


def _rectangle(read: Read, width: int) -> tuple[int, int, int, int] | None:
    """Rows and columns ``(r0, r1, c0, c1)`` (ends exclusive) of a row-major matrix
    ``width`` wide that a strided view reads: each of its dimensions must step whole rows
    or single columns (at most one of those)."""
    offset, shape, stride = read
    if 0 in shape:
        return 0, 0, 0, 0
    run = 1
    last = offset
    for size, step in zip(shape, stride, strict=True):
        if size == 1:
            continue
        if step == 1 and run == 1:
            run = size
        elif step % width != 0 or step <= 0:
            return None
        last += (size - 1) * step
    first_col = offset % width
    if first_col + run > width:
        return None
    return offset // width, last // width + 1, first_col, first_col + run
