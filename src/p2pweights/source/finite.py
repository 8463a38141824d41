"""The opt-in NaN / Inf check of a trainer's tensors (``SyncConfig(verify_finite_inputs=True)``).

Off by default: it reads every byte once more, on the tensor's own device (about 4
TB/s for bf16 and 1 TB/s for fp8 on an H200; a few GB/s on a CPU core).
"""

from __future__ import annotations

import torch

from p2pweights.errors import ConfigError

__all__ = ["check_finite"]

_FP8_NON_FINITE = {
    getattr(torch, name): codes
    for name, codes in {
        # (mask, pattern): a byte b is NaN or Inf when b & mask == pattern; and the
        # smallest such codes read as int8 (positive) and as uint8 (negative), so
        # that a max over the bytes finds one with no temporary: e4m3fn has no Inf,
        # its NaNs are 0x7F and 0xFF; e5m2's Infs and NaNs are 0x7C-0x7F, 0xFC-0xFF.
        "float8_e4m3fn": (0x7F, 0x7F, 0x7F, 0xFF),
        "float8_e5m2": (0x7C, 0x7C, 0x7C, 0xFC),
        "float8_e8m0fnu": (0xFF, 0xFF, None, 0xFF),
    }.items()
    if hasattr(torch, name)
}


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ConfigError`` if the floating ``tensor`` holds NaN or Inf.

    Reductions on the tensor's own device, no copy of it, one bool back to the host:
    a sum is finite only if every element is (NaN and Inf survive any addition), and
    a sum that overflows although every element is finite is recounted exactly. fp8
    formats, which torch cannot sum, are checked on their bytes (two max reductions).
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    codes = _FP8_NON_FINITE.get(tensor.dtype)
    if codes is not None:
        mask, pattern, positive, negative = codes
        found = tensor.view(torch.uint8).max() >= negative
        if positive is not None:
            found |= tensor.view(torch.int8).max() >= positive
        if not found:
            return
        count = int(tensor.view(torch.uint8).bitwise_and(mask).eq_(pattern).sum())
    elif tensor.dtype.itemsize == 1:  # fnuz fp8 formats and others torch cannot sum
        count = int(tensor.float().isfinite().logical_not_().sum())
    else:
        if torch.isfinite(tensor.sum()):
            return
        count = int(torch.isfinite(tensor).logical_not_().sum())
    if count == 0:
        return
    raise ConfigError(
        f"HF tensor {name!r} holds {count} NaN or Inf value(s) among {tensor.numel()} "
        f"(checked because SyncConfig(verify_finite_inputs=True))"
    )
