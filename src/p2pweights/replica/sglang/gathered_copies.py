"""Many recorded copies of a replayed load in one kernel launch, on a GPU.

A replayed load repeats the copies sglang's loader made: for an MoE layer, thousands of
small strided copies (each expert's TP slice into its place in the fused parameter).
Issued one by one, each costs a view of its source, a view of its destination and a
launch in Python, about 10 us of host time, for copies the GPU does in a fraction of
that. Here the copies of one step (destinations that do not overlap, so their order
cannot matter) are described once, when the replay first runs on a GPU: per copy its
source and destination (owner and byte offset), and its shape as rows x columns with a
row stride on each side; and the work is cut into chunks. Every later run only reads
the owners' addresses (one ``data_ptr`` each), sends them to the GPU and launches one
Triton program per chunk.

Bytes move unchanged, in units of 1 to 8 bytes (the largest that divides every offset,
row and stride of a copy, so a bf16 copy usually moves as int64): only copies of one
dtype whose both sides are one contiguous run or rows of contiguous columns are taken;
the others (and every copy of a step with fewer than ``MIN_COPIES``, where a launch
costs more than it saves) stay with ``torch._foreach_copy_``. A run whose owners are
not aligned to a launch's unit gives that launch's copies to ``_foreach_copy_``.

Only on CUDA with Triton; ``P2PWEIGHTS_COPY_KERNEL=0`` turns it off. A kernel that fails
to compile or launch gives way to ``_foreach_copy_`` for the rest of the process, with
one warning. A replay is checked against the loader once, on the load that confirms it
(replay.py; on a GPU that check runs this kernel), not on later loads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2pweights import environment

__all__ = [
    "GatheredCopies",
    "MIN_COPIES",
    "Shape2d",
    "as_rows",
    "available",
    "owner_addresses",
    "run_or_give_up",
]

logger = logging.getLogger(__name__)

MIN_COPIES = 16
"""Steps with fewer copies keep ``_foreach_copy_`` (one Triton launch costs about as
much host time as a dozen of its views)."""
_BLOCK = 4096
"""Units per program: 32 KiB of int64."""
_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_broken: list[str] = []
"""Why the kernel is unusable in this process, if it is."""


def available(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and not _broken
        and environment.copy_kernel_allowed()
        and torch.version.hip is None
        and _kernel() is not None
    )


@dataclass(frozen=True)
class Shape2d:
    """A copy as ``rows`` x ``cols`` elements, rows ``src_stride`` / ``dst_stride`` apart."""

    rows: int
    cols: int
    src_stride: int
    dst_stride: int

    @property
    def flat(self) -> bool:
        return self.rows == 1 or (self.src_stride == self.cols and self.dst_stride == self.cols)


def as_rows(
    shape: Sequence[int], src_stride: Sequence[int], dst_stride: Sequence[int]
) -> Shape2d | None:
    """``shape`` copied between the two strides as rows of contiguous columns, or None
    when it is not one (a transpose, a column gather) or has 2**31 elements or more in
    rows (the kernel divides in int32)."""
    dims = [(n, s, d) for n, s, d in zip(shape, src_stride, dst_stride, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, s, d in dims:
        if merged:
            outer_n, outer_s, outer_d = merged[-1]
            if outer_s == s * n and outer_d == d * n:
                merged[-1] = (outer_n * n, s, d)
                continue
        merged.append((n, s, d))
    if not merged:
        return Shape2d(1, 1 if 0 not in shape else 0, 1, 1)
    if merged[-1][1] != 1 or merged[-1][2] != 1 or len(merged) > 2:
        return None
    cols = merged[-1][0]
    if len(merged) == 1:
        return Shape2d(1, cols, cols, cols)
    rows, src_rows, dst_rows = merged[0]
    shaped = Shape2d(rows, cols, src_rows, dst_rows)
    return shaped if shaped.flat or rows * cols < 2**31 else None


@dataclass(frozen=True)
class _Described:
    src_owner: int
    src_offset: int
    """Bytes from the owner's first byte."""
    dst_owner: int
    dst_offset: int
    shape: Shape2d
    itemsize: int

    def unit(self) -> int:
        s = self.shape
        strides = (s.cols, s.src_stride, s.dst_stride)
        sizes = (self.src_offset, self.dst_offset, *(n * self.itemsize for n in strides))
        return next(u for u in _UNITS if all(size % u == 0 for size in sizes))


class _Launch:
    """The copies of one step that move in one unit and one kind (flat or rows)."""

    def __init__(
        self, copies: Sequence[_Described], positions: list[int], unit: int, device: torch.device
    ):
        self.unit = unit
        # Where its copies stand in the list the ``GatheredCopies`` was made from.
        self.positions = positions
        self.flat = all(c.shape.flat for c in copies)
        rows: list[list[int]] = []
        chunk_copy: list[int] = []
        chunk_start: list[int] = []
        for index, c in enumerate(copies):
            s = c.shape
            count = (s.rows * s.cols * c.itemsize) // unit
            cols = (s.cols * c.itemsize) // unit
            rows.append(
                [
                    c.src_owner,
                    c.src_offset,
                    c.dst_owner,
                    c.dst_offset,
                    count,
                    count if self.flat else cols,
                    (s.src_stride * c.itemsize) // unit,
                    (s.dst_stride * c.itemsize) // unit,
                ]
            )
            for start in range(0, count, _BLOCK):
                chunk_copy.append(index)
                chunk_start.append(start)
        self.owners = sorted({c.src_owner for c in copies} | {c.dst_owner for c in copies})
        self.meta = torch.tensor(rows, dtype=torch.int64, device=device)
        self.chunk_copy = torch.tensor(chunk_copy, dtype=torch.int32, device=device)
        self.chunk_start = torch.tensor(chunk_start, dtype=torch.int64, device=device)
        self.like = torch.empty(1, dtype=_UNITS[unit], device=device)


class GatheredCopies:
    """The kernel-able copies of one replay step, described once for a device."""

    def __init__(
        self,
        copies: Sequence[tuple[int, int, int, int, Shape2d, int]],
        device: torch.device,
    ):
        """``copies``: (source owner, source byte offset, destination owner, destination
        byte offset, shape, item size), owners numbered as the addresses ``run`` gets."""
        by_kind: dict[tuple[int, bool], tuple[list[_Described], list[int]]] = {}
        for position, described in enumerate(_Described(*c) for c in copies):
            kind = by_kind.setdefault((described.unit(), described.shape.flat), ([], []))
            kind[0].append(described)
            kind[1].append(position)
        self._launches = [
            _Launch(kind, positions, unit, device)
            for (unit, _), (kind, positions) in by_kind.items()
        ]
        self._device = device

    def run(self, addresses: Sequence[int]) -> list[int]:
        """Copy, given each owner's address now (``data_ptr``), on the current stream;
        the positions of the copies left to the caller: those of a launch some owner of
        which is not aligned to its unit (a view into the middle of a tensor)."""
        kernel = _kernel()
        bases = torch.tensor(addresses, dtype=torch.int64, device=self._device)
        left: list[int] = []
        # Triton launches on the current device: switch when the copies are on another
        device = self._device
        elsewhere = device.type == "cuda" and device.index != torch.cuda.current_device()
        with torch.cuda.device(device) if elsewhere else contextlib.nullcontext():
            for launch in self._launches:
                if all(addresses[owner] % launch.unit == 0 for owner in launch.owners):
                    self._launch(kernel, bases, launch)
                else:
                    left += launch.positions
        return left

    def _launch(self, kernel: Any, bases: torch.Tensor, launch: _Launch) -> None:
        kernel[(len(launch.chunk_copy),)](
            bases,
            launch.meta,
            launch.chunk_copy,
            launch.chunk_start,
            launch.like,
            BLOCK=_BLOCK,
            FLAT=launch.flat,
            num_warps=4,
        )


def run_or_give_up(copies: GatheredCopies, addresses: Sequence[int]) -> list[int] | None:
    """``copies.run``: the positions of the copies left to the caller; None (all of
    them) if the kernel was given up on or fails now (then for the rest of this process,
    with one warning)."""
    if _broken:
        return None
    try:
        return copies.run(addresses)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:
        _broken.append(f"{type(exc).__name__}: {exc}")
        logger.warning("the gathered-copies kernel failed (%s); copies go one by one", exc)
        return None


@functools.cache
def _kernel() -> Any:
    try:
        from p2pweights.replica.sglang import _copies_triton
    except ImportError:
        return None
    return _copies_triton.gathered_copies


def owner_addresses(
    inputs: Sequence[torch.Tensor], targets: Mapping[str, torch.Tensor], names: Sequence[str]
) -> list[int]:
    """Owner addresses in the numbering a ``GatheredCopies`` uses: inputs, then ``names``."""
    return [t.data_ptr() for t in inputs] + [targets[n].data_ptr() for n in names]
