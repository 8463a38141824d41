"""Block-fp8 quantization of a GPU weight in one pass (a Triton kernel).

``fp8_block.quantize`` in torch makes several passes over a weight (min, max, the
scaled product, the clamp, the cast, the copy out of the padded view). On a GPU the
whole job is memory-bound: read 2 bytes of bf16, write 1 byte of fp8, per element.
Here each Triton program owns one scaling block: it loads the block once, takes its
absolute maximum, computes the scale and writes the fp8 block and its scale.

Bit-equal to the torch quantizer, operation by operation (checked on an H200 by
``tests/integration/test_fp8_fused_gpu.py`` and ``benchmarks/fp8_quantize.py``):

* the maximum of ``|w|`` is exact in any float format; a block holding a NaN gets a
  NaN maximum, as ``torch.amax`` gives;
* ``max(amax, 1e-4)`` and ``amax / 448`` are float32, the division correctly rounded
  (``div_rn``; torch divides by a tensor, not by a reciprocal);
* ue8m0 rounds the scale up to a power of two with the same integer bit operations;
* ``1 / scale`` is correctly rounded, as torch's ``reciprocal``; the product with the
  bf16 weight is a float32 multiply; the clamp to ``[-448, 448]`` keeps NaN;
* the cast to e4m3 rounds to nearest even, as torch's; a NaN keeps its sign bit
  (``0x7F`` / ``0xFF``), as torch's cast does.

Only used for CUDA tensors when Triton imports (``available()``);
``P2PWEIGHTS_FUSED_FP8=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from p2pweights import environment

__all__ = ["available", "quantize_fused"]


def available(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can take the fused path (a CUDA tensor, Triton present)."""
    return weight.is_cuda and environment.fused_fp8_allowed() and _kernel() is not None


def quantize_fused(
    weight: torch.Tensor, block: tuple[int, int], ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of a CUDA ``weight`` ``[..., N, K]``."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the fused fp8 quantizer needs Triton")
    rows, cols = weight.shape[-2:]
    lead = weight.shape[:-2]
    matrices = weight.reshape(-1, rows, cols)  # a view unless the leading dims are strided
    bn, bk = block
    grid_rows, grid_cols = -(-rows // bn), -(-cols // bk)
    q = torch.empty(
        (matrices.shape[0], rows, cols), dtype=torch.float8_e4m3fn, device=weight.device
    )
    scale = torch.empty(
        (matrices.shape[0], grid_rows, grid_cols), dtype=torch.float32, device=weight.device
    )
    if q.numel():
        # Triton launches on the current device: switch only when the weight is elsewhere
        on_weights_gpu = (
            contextlib.nullcontext()
            if weight.device.index == torch.cuda.current_device()
            else torch.cuda.device(weight.device)
        )
        with on_weights_gpu:
            kernel[(matrices.shape[0], grid_rows, grid_cols)](
                matrices,
                q.view(torch.uint8),
                scale,
                rows,
                cols,
                *matrices.stride(),
                BN=bn,
                BK=bk,
                PAD_N=_pow2(bn),
                PAD_K=_pow2(bk),
                UE8M0=ue8m0,
                num_warps=4,  # the fastest of 4, 8 and 16 on an H200 (fp8_kernel_variants.py)
            )
    return q.reshape(*lead, rows, cols), scale.reshape(*lead, grid_rows, grid_cols)


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
