"""The Triton kernel behind ``fp8_fused`` (imported only where Triton is)."""

# mypy: ignore-errors
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_fp8(
    w_ptr,
    table_ptr,
    q_ptr,
    scale_ptr,
    rows,
    cols,
    row0,
    col0,
    stride_m,
    stride_r,
    stride_c,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PAD_N: tl.constexpr,
    PAD_K: tl.constexpr,
    UE8M0: tl.constexpr,
    TABLE: tl.constexpr,
):
    """One scaling block of one matrix: fp8 bytes into ``q_ptr`` (uint8), the float32
    scale into ``scale_ptr``. Grid: (matrix, block row, block column). Matrix ``m``
    starts at ``w_ptr + m * stride_m``, or with ``TABLE`` at the address ``table_ptr[m]``
    (separate tensors of one shape, dtype and strides as ``w_ptr``'s, in one launch).
    Blocks ``row0`` and ``col0`` on: the grid may cover only some of a matrix's blocks."""
    matrix = tl.program_id(0).to(tl.int64)
    if TABLE:
        base = tl.load(table_ptr + matrix).to(tl.pointer_type(w_ptr.dtype.element_ty))
    else:
        base = w_ptr + matrix * stride_m
    block_row = tl.program_id(1) + row0
    block_col = tl.program_id(2) + col0
    r = block_row * BN + tl.arange(0, PAD_N)
    c = block_col * BK + tl.arange(0, PAD_K)
    inside = (
        (r[:, None] < rows)
        & (c[None, :] < cols)
        & (tl.arange(0, PAD_N)[:, None] < BN)
        & (tl.arange(0, PAD_K)[None, :] < BK)
    )
    rows_at = r[:, None].to(tl.int64)
    cols_at = c[None, :].to(tl.int64)
    src = base + rows_at * stride_r + cols_at * stride_c
    w = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(w), None, _max_keeping_nan)
    amax = tl.maximum(amax, 1e-4, propagate_nan=tl.PropagateNan.ALL)
    scale = tl.math.div_rn(amax, 448.0)
    if UE8M0:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        exponent = tl.minimum(tl.maximum(exponent, 1), 254)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = tl.math.div_rn(1.0, scale)
    x = tl.clamp(w * inverse, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    q = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    negative = x.to(tl.int32, bitcast=True) < 0
    q = tl.where(x != x, tl.where(negative, 0xFF, 0x7F).to(tl.uint8), q)
    dst = q_ptr + matrix * rows * cols + rows_at * cols + cols_at
    tl.store(dst, q, mask=inside)
    grid_rows = tl.cdiv(rows, BN)
    grid_cols = tl.cdiv(cols, BK)
    tl.store(scale_ptr + (matrix * grid_rows + block_row) * grid_cols + block_col, scale)
