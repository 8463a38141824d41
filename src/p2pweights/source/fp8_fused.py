"""Block-fp8 quantization of a GPU weight in one pass (a Triton kernel).

``fp8_block.quantize`` in torch makes several passes over a weight (min, max, the
scaled product, the clamp, the cast, the copy out of the padded view). On a GPU the
whole job is memory-bound: read 2 bytes of bf16, write 1 byte of fp8, per element.
Here each Triton program owns one scaling block: it loads the block once, takes its
absolute maximum, computes the scale and writes the fp8 block and its scale.

Bit-equal to the torch quantizer, operation by operation (checked on an H200 by
``tests/integration/test_fp8_fused_gpu.py`` and ``benchmarks/fp8.py convert``):

* the maximum of ``|w|`` is exact in any float format; a block holding a NaN gets a
  NaN maximum, as ``torch.amax`` gives;
* ``max(amax, 1e-4)`` and ``amax / 448`` are float32, the division correctly rounded
  (``div_rn``; torch divides by a tensor, not by a reciprocal);
* ue8m0 rounds the scale up to a power of two with the same integer bit operations;
* ``1 / scale`` is correctly rounded, as torch's ``reciprocal``; the product with the
  bf16 weight is a float32 multiply; the clamp to ``[-448, 448]`` keeps NaN;
* the cast to e4m3 rounds to nearest even, as torch's; a NaN keeps its sign bit
  (``0x7F`` / ``0xFF``), as torch's cast does.

Only used where it was checked (``available()``): plain CUDA tensors on NVIDIA GPUs
of compute capability 8.9 or more (Triton casts to e4m3 in hardware there; older GPUs
cannot compile the kernel), with Triton importable and blocks and grids within what one
launch takes. Should the kernel fail to compile or launch anyway, torch's quantizer
takes over for the rest of the process (same bytes), with one warning.
``P2PWEIGHTS_FUSED_FP8=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from p2pweights import environment

__all__ = [
    "available",
    "usable",
    "quantize_fused",
    "quantize_batch",
    "quantize_or_none",
    "quantize_batch_or_none",
]

T = TypeVar("T")
Box = tuple[int, int, int, int]
"""Blocks (first row, end row, first column, end column) of a matrix, ends exclusive."""

logger = logging.getLogger(__name__)

_MIN_CAPABILITY = (8, 9)
"""Triton's e4m3 cast needs Ada / Hopper or newer."""
_MAX_GRID = 65535
"""CUDA's limit on a launch grid's second and third dimensions (block rows, columns)."""
_MAX_BLOCK_ELEMENTS = 1 << 16
"""Larger scaling blocks than 256 x 256 stay on torch (registers, Triton's tensor limit)."""
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Weights it takes: float32 holds them exactly, as torch's math does (float64 stays on
torch, whose math then runs in float64)."""
poison_unset = False
"""Tests: fill the blocks a box leaves unset with NaN (fp8 ``0x7F``, NaN scales) instead
of leaving whatever memory held, so that a read outside the box cannot go unseen."""
_broken: list[str] = []
"""Why the kernel is unusable in this process, if it is (a message: an exception would
keep its traceback's frames, and the tensors they hold, alive)."""


def available(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> bool:
    """Whether ``weight`` takes the fused path (see the module's docstring)."""
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or not weight.is_cuda:
        return False  # a subclass (DTensor, ...) keeps torch's dispatch
    return usable(weight.device, tuple(weight.shape), block, weight.dtype)


def usable(
    device: torch.device,
    shape: tuple[int, ...],
    block: tuple[int, int],
    dtype: torch.dtype = torch.bfloat16,
) -> bool:
    """Whether the kernel runs for a CUDA weight of ``shape`` and ``dtype`` on ``device``."""
    if _broken or not environment.fused_fp8_allowed() or torch.version.hip is not None:
        return False
    if dtype not in _DTYPES:
        return False
    if len(shape) < 2:
        return False  # torch's path refuses it, saying why
    bn, bk = block
    rows, cols = shape[-2:]
    if bn * bk > _MAX_BLOCK_ELEMENTS or -(-rows // bn) > _MAX_GRID or -(-cols // bk) > _MAX_GRID:
        return False
    return _capable(device) and _kernel() is not None


DEVICES_KEPT = 16
"""Devices whose capability is remembered (a host's GPUs)."""


@functools.lru_cache(maxsize=DEVICES_KEPT)
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= _MIN_CAPABILITY


def quantize_or_none(
    weight: torch.Tensor, block: tuple[int, int], ue8m0: bool, box: Box | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quantize_fused``, or None (the caller quantizes with torch) if the kernel cannot
    run here: it is then given up on for this process, with one warning."""
    return _or_none(lambda: quantize_fused(weight, block, ue8m0, box))


def quantize_batch_or_none(
    weights: Sequence[torch.Tensor], block: tuple[int, int], ue8m0: bool, box: Box | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``quantize_batch``, or None as ``quantize_or_none``."""
    return _or_none(lambda: quantize_batch(weights, block, ue8m0, box))


def _or_none(quantize: Callable[[], T]) -> T | None:
    try:
        return quantize()
    except (torch.cuda.OutOfMemoryError, ValueError):
        raise  # not the kernel's fault (memory; the caller's blocks or weights)
    except Exception as exc:  # a compile or launch failure: torch gives the same bytes
        _broken.append(f"{type(exc).__name__}: {exc}")
        logger.warning("the fused fp8 kernel failed (%s); torch quantizes from now on", exc)
        return None


def quantize_fused(
    weight: torch.Tensor, block: tuple[int, int], ue8m0: bool, box: Box | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of a CUDA ``weight`` ``[..., N, K]``; with a
    ``box`` of blocks ``(first row, end row, first column, end column)``, only those
    blocks of each matrix are written (the rest of both outputs is left unset)."""
    rows, cols = weight.shape[-2:]
    matrices = weight.reshape(-1, rows, cols)  # a view unless the leading dims are strided
    q, scale = _launch(matrices, None, matrices.shape[0], block, ue8m0, box)
    lead = weight.shape[:-2]
    return q.reshape(*lead, rows, cols), scale.reshape(*lead, *scale.shape[-2:])


def quantize_batch(
    weights: Sequence[torch.Tensor], block: tuple[int, int], ue8m0: bool, box: Box | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``quantize_fused`` of each weight (the same ``box`` for all), in one launch: the
    weights are separate tensors of one shape, dtype, device and strides (e.g. a layer's
    experts). The results are views of two stacked tensors, alive while any of them is."""
    if not weights:
        return []
    first = weights[0]
    alike = (first.shape, first.dtype, first.device, first.stride())
    if any((w.shape, w.dtype, w.device, w.stride()) != alike for w in weights):
        raise ValueError("quantize_batch takes weights of one shape, dtype, device and strides")
    rows, cols = first.shape[-2:]
    lead = first.shape[:-2]
    # a view unless the leading dims are strided (then a copy, kept until the launch)
    matrices = [w.reshape(-1, rows, cols) for w in weights] if lead else [first.unsqueeze(0)]
    if lead:
        step = matrices[0].stride(0) * first.element_size()
        count = matrices[0].shape[0]
        addresses = [m.data_ptr() + j * step for m in matrices for j in range(count)]
    else:
        addresses = [w.data_ptr() for w in weights]
    table = torch.tensor(addresses, dtype=torch.int64, device=first.device)
    q, scale = _launch(matrices[0], table, len(addresses), block, ue8m0, box)
    q = q.view(len(weights), *lead, rows, cols)
    scale = scale.view(len(weights), *lead, *scale.shape[-2:])
    return list(zip(q.unbind(0), scale.unbind(0), strict=True))  # views in one call each


def _launch(
    matrices: torch.Tensor,
    table: torch.Tensor | None,
    count: int,
    block: tuple[int, int],
    ue8m0: bool,
    box: Box | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``count`` matrices ``[rows, cols]`` into new stacked outputs: those of
    ``matrices`` (``[count, rows, cols]``), or with a ``table`` of addresses, matrices
    laid out as ``matrices[0]`` at each address; all blocks, or those of ``box``."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the fused fp8 quantizer needs Triton")
    _, rows, cols = matrices.shape
    bn, bk = block
    grid_rows, grid_cols = -(-rows // bn), -(-cols // bk)
    row0, row1, col0, col1 = box if box is not None else (0, grid_rows, 0, grid_cols)
    if box is not None:
        check_box(box, (grid_rows, grid_cols))
    device = matrices.device
    q, scale = new_outputs((count, rows, cols), (count, grid_rows, grid_cols), device, box)
    if q.numel() and row1 > row0 and col1 > col0:
        # Triton launches on the current device: switch only when the weight is on
        # another GPU (a CPU weight runs only under Triton's interpreter, in the tests)
        elsewhere = matrices.is_cuda and device.index != torch.cuda.current_device()
        on_weights_gpu = torch.cuda.device(device) if elsewhere else contextlib.nullcontext()
        with on_weights_gpu:
            kernel[(count, row1 - row0, col1 - col0)](
                matrices,
                matrices if table is None else table,  # unread without TABLE
                q.view(torch.uint8),
                scale,
                rows,
                cols,
                row0,
                col0,
                *matrices.stride(),
                BN=bn,
                BK=bk,
                PAD_N=_pow2(bn),
                PAD_K=_pow2(bk),
                UE8M0=ue8m0,
                TABLE=table is not None,
                num_warps=4,  # the fastest of 4, 8 and 16 on an H200 (benchmarks/fp8.py kernel)
            )
    return q, scale


def check_box(box: Box, grid: tuple[int, int]) -> None:
    """Refuse a box of blocks that is not inside a ``grid`` (block rows, block columns)."""
    row0, row1, col0, col1 = box
    if not (0 <= row0 <= row1 <= grid[0] and 0 <= col0 <= col1 <= grid[1]):
        raise ValueError(f"blocks {box} are outside a weight of {grid[0]} x {grid[1]} blocks")


def new_outputs(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], device: torch.device, box: Box | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp8 and scale outputs; with a box, the blocks it leaves out are NaN where
    ``poison_unset`` asks (tests)."""
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(scale_shape, dtype=torch.float32, device=device)
    if box is not None and poison_unset:
        q.view(torch.uint8).fill_(0x7F)
        scale.fill_(float("nan"))
    return q, scale


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, or None where Triton does not import."""
    try:
        from p2pweights.source import _fp8_triton
    except ImportError:
        return None
    return _fp8_triton.block_fp8
