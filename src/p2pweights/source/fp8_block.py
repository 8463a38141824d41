"""Block-wise fp8 quantization into the DeepSeek-V3 / Kimi-K2 checkpoint format.

An engine started from a block-quantized fp8 checkpoint (``quantization_config``
``{"quant_method": "fp8", "weight_block_size": [bn, bk], ...}``) loads each quantized
linear weight as two checkpoint tensors:

* ``<name>``: ``float8_e4m3fn``, the weight's shape;
* ``<name>_scale_inv``: ``float32``, ``[ceil(N / bn), ceil(K / bk)]``, the factor
  that turns a block of the fp8 weight back into real values (``w ~ q * scale_inv``).

A trainer holds bf16 weights. ``quantize`` produces that pair the way the
checkpoints were made: per block, ``scale = max(|w|, 1e-4) / 448`` (448 is the largest
finite e4m3 value), rounded up to a power of two when the config says
``scale_fmt: "ue8m0"`` (DeepSeek-V3.1 style, what DeepGEMM reads on Blackwell), and
``q = fp8(w * (1 / scale))``. Blocks at the right and bottom edges may be partial; they
are scaled by their own maximum. The math runs in float32 on the weight's own device;
on a GPU, a one-pass Triton kernel (``fp8_fused``) gives the same bits.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2pweights.errors import ConfigError
from p2pweights.source import fp8_fused
from p2pweights.source.fp8_fused import Box

__all__ = [
    "BlockFp8Format",
    "Box",
    "quantize",
    "quantize_many",
    "partial",
    "complete",
    "dequantize",
    "SCALE_SUFFIX",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_AMAX = 1e-4
SCALE_SUFFIX = "_scale_inv"
"""A quantized weight ``x.weight`` travels with ``x.weight_scale_inv``."""


@dataclass(frozen=True)
class BlockFp8Format:
    """How an fp8 engine's checkpoint quantizes its linear weights."""

    block: tuple[int, int]
    """(rows, columns) of one scaling block: the config's ``weight_block_size``."""
    ue8m0: bool = False
    """Scales are powers of two (``scale_fmt: "ue8m0"``)."""

    @classmethod
    def from_quantization_config(cls, config: Mapping[str, Any] | None) -> BlockFp8Format | None:
        """The format of an HF ``quantization_config``; None unless it is block fp8."""
        if not config or config.get("quant_method") != "fp8":
            return None
        block = config.get("weight_block_size")
        if block is None:
            return None  # per-tensor / per-channel fp8 is not a block format
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ConfigError(f"weight_block_size must be two positive integers, got {block!r}")
        fmt = config.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ConfigError(f"fp8 checkpoints in format {fmt!r} are not supported (e4m3 only)")
        scale_fmt = config.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ConfigError(f"fp8 scale_fmt {scale_fmt!r} is not supported (none or ue8m0)")
        return cls((int(block[0]), int(block[1])), ue8m0=scale_fmt == "ue8m0")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The ``_scale_inv`` shape for a weight of ``shape`` (leading dims kept)."""
        if len(shape) < 2:
            raise ConfigError(f"block fp8 quantizes matrices, got shape {shape}")
        rows, cols = shape[-2:]
        bn, bk = self.block
        return (*shape[:-2], -(-rows // bn), -(-cols // bk))


def quantize(
    weight: torch.Tensor, fmt: BlockFp8Format, box: Box | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of ``weight`` (``[..., N, K]``), on its device.

    With a ``box`` of blocks (first row, end row, first column, end column; ends
    exclusive), only those blocks are quantized: a block's bytes and scale depend on its
    own values alone, so they equal the whole weight's there; the rest of both outputs
    is left unset, and both are marked ``partial`` (``complete`` fills the rest)."""
    _check_quantizable(weight)
    if box is not None:
        return _quantize_box(weight, fmt, box)
    if fp8_fused.available(weight, fmt.block):
        fused = fp8_fused.quantize_or_none(weight, fmt.block, fmt.ue8m0)
        if fused is not None:
            return fused  # the same bits, in one pass
    # The blocks stay in the weight's dtype: max and min are exact in any float format,
    # and the multiply below promotes to float32 in the same pass (bf16 -> float32 is
    # exact), so no float32 copy of the weight and no |w| temporary are made.
    blocks, (rows, cols) = _blocks(weight, fmt)
    dims = (-3, -1)
    amax = torch.maximum(blocks.amax(dim=dims, keepdim=True), -blocks.amin(dim=dims, keepdim=True))
    amax = amax.float().clamp(min=_MIN_AMAX)
    # A true division on every device: CUDA turns division by a Python number into a
    # multiply by its rounded reciprocal (1 ulp off in most scales); by a tensor on the
    # same device it divides, as the CPU does (found on an H200, see docs/benchmarks-archive.md).
    scale = amax / torch.tensor(FP8_MAX, dtype=torch.float32, device=amax.device)
    if fmt.ue8m0:
        scale = _ceil_power_of_two(scale)
    quantized = torch.mul(blocks, 1.0 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    padded_shape = (*weight.shape[:-2], blocks.shape[-4] * blocks.shape[-3], -1)
    q = quantized.reshape(padded_shape)[..., :rows, :cols].contiguous()
    return q, scale.squeeze(-1).squeeze(-2).contiguous()


def quantize_many(
    weights: Sequence[torch.Tensor],
    fmt: BlockFp8Format,
    boxes: Sequence[Box | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``quantize`` of each weight (in ``boxes[i]`` where given), the same bits; GPU
    weights of one shape, dtype, strides and box (a layer's experts) share one launch
    of the fused kernel, whose host cost per launch is most of a small weight's
    quantization (docs/benchmarks-archive.md)."""
    boxes = boxes if boxes is not None else [None] * len(weights)
    alike: dict[tuple[object, ...], list[int]] = {}
    for i, (weight, box) in enumerate(zip(weights, boxes, strict=True)):
        key = (type(weight), weight.shape, weight.dtype, weight.device, weight.stride(), box)
        alike.setdefault(key, []).append(i)
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(weights)  # type: ignore[list-item]
    for batch in alike.values():
        first, box = weights[batch[0]], boxes[batch[0]]
        _check_quantizable(first)
        done = None
        if len(batch) > 1 and fp8_fused.available(first, fmt.block):
            done = fp8_fused.quantize_batch_or_none(
                [weights[i] for i in batch], fmt.block, fmt.ue8m0, box
            )
            if done is not None and box is not None:
                for i, pair in zip(batch, done, strict=True):
                    _mark_partial(weights[i], fmt, pair)
        for k, i in enumerate(batch):
            out[i] = done[k] if done is not None else quantize(weights[i], fmt, box)
    return out


def partial(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` came out of ``quantize`` with a box: set only in its blocks."""
    return getattr(tensor, _PARTIAL, None) is not None


def complete(tensor: torch.Tensor) -> None:
    """Quantize the rest of a ``partial`` output (and of its pair, weight or scale) in
    place, from the weight it was made of: for a loader that reads outside the box."""
    finish = getattr(tensor, _PARTIAL, None)
    if finish is not None:
        finish()


_PARTIAL = "_p2pweights_partial"
_completing = threading.Lock()


def _mark_partial(
    weight: torch.Tensor, fmt: BlockFp8Format, pair: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """Mark both outputs partial; ``complete`` of either fills both whole (the closure
    keeps ``weight`` alive as long as an output is)."""
    q, scale = pair

    def finish() -> None:
        with _completing:  # two ranks' loads may ask at once
            if not partial(q):
                return
            whole_q, whole_scale = quantize(weight, fmt)
            q.copy_(whole_q)
            scale.copy_(whole_scale)
            for tensor in pair:
                delattr(tensor, _PARTIAL)

    for tensor in pair:
        setattr(tensor, _PARTIAL, finish)


def _quantize_box(
    weight: torch.Tensor, fmt: BlockFp8Format, box: Box
) -> tuple[torch.Tensor, torch.Tensor]:
    row0, row1, col0, col1 = box
    grid = fmt.scale_shape(tuple(weight.shape))
    fp8_fused.check_box(box, grid[-2:])  # type: ignore[arg-type]
    pair: tuple[torch.Tensor, torch.Tensor] | None = None
    if fp8_fused.available(weight, fmt.block):
        pair = fp8_fused.quantize_or_none(weight, fmt.block, fmt.ue8m0, box)
    if pair is None:
        bn, bk = fmt.block
        rows, cols = slice(row0 * bn, row1 * bn), slice(col0 * bk, col1 * bk)
        q, scale = fp8_fused.new_outputs(tuple(weight.shape), grid, weight.device, box)
        part_q, part_scale = quantize(weight[..., rows, cols], fmt)
        q[..., rows, cols], scale[..., row0:row1, col0:col1] = part_q, part_scale
        pair = (q, scale)
    _mark_partial(weight, fmt, pair)
    return pair


def _check_quantizable(weight: torch.Tensor) -> None:
    if not weight.is_floating_point() or weight.dtype == FP8:
        raise ConfigError(f"quantize takes a floating weight in high precision, got {weight.dtype}")


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFp8Format) -> torch.Tensor:
    """float32 values of a quantized pair (for checks)."""
    bn, bk = fmt.block
    scale = scale_inv.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return q.float() * scale[..., : q.shape[-2], : q.shape[-1]]


def _blocks(weight: torch.Tensor, fmt: BlockFp8Format) -> tuple[torch.Tensor, tuple[int, int]]:
    """``weight`` zero-padded to whole blocks, viewed ``[..., N/bn, bn, K/bk, bk]``."""
    bn, bk = fmt.block
    rows, cols = weight.shape[-2:]
    pad_rows, pad_cols = -rows % bn, -cols % bk
    if pad_rows or pad_cols:
        weight = torch.nn.functional.pad(weight, (0, pad_cols, 0, pad_rows))
    view = weight.reshape(
        *weight.shape[:-2], (rows + pad_rows) // bn, bn, (cols + pad_cols) // bk, bk
    )
    return view, (rows, cols)


def _ceil_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``x`` (positive, normal float32), exactly."""
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)
