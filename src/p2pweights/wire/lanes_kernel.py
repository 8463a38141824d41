"""The lane sums of many GPU regions in one Triton launch (the digest's fast path).

Digested one by one, each region costs a few launches and some Python: the 227
parameters of a 1 GB model took 3.5-6.3 ms on an H200 (0.2-0.3 TB/s), where one
launch of this kernel takes 0.6 ms (docs/benchmarks-archive.md, "Verified writes: cost").
Here every region of one device is cut into chunks of ``CHUNK_WORDS`` int64 words (the
last of a region shorter; longer chunks where the regions come to many GB:
``_chunk_blocks``), one Triton program per chunk sums its words into the ``LANES`` lanes,
plain and weighted by row (``digest`` defines both), and a cumulative sum over the chunks
gives each region's sums: one launch and three small torch ops for any number of regions, and
no tensor view per region (their addresses and lengths are all it takes). A chunk's
weighted sums are taken with its rows counted from the region's first, so a region's
chunks add up to its own.
The chunk table depends only on the regions' sizes and is kept (``_LAYOUTS``): the same
slots and parameters come back every update. Integer sums are exact, so the result
equals the torch path's (``digest._lanes``) bit for bit.

Only on CUDA with Triton, for regions at 8-aligned addresses (``digest.lane_sums`` gives
the others to torch); ``P2PWEIGHTS_DIGEST_KERNEL=0`` turns it off. A kernel that fails to
compile or launch gives way to torch for the rest of the process, with one warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from p2pweights import environment
from p2pweights.bounded_cache import LruCache

LANES = 16
"""Word ``i`` of a region is summed into lane ``i % LANES`` (``digest.LANES``)."""
SUMS = 2 * LANES
"""Sums per region: ``LANES`` plain, then ``LANES`` weighted by row (``digest.SUMS``)."""

__all__ = ["CHUNK_WORDS", "LANES", "SUMS", "kernel_lanes", "usable"]

logger = logging.getLogger(__name__)

_BLOCK = 2048
"""Words one loop step of a program reads (8 per thread at 8 warps)."""
_MIN_BLOCKS = 256
"""Blocks per chunk where the regions come to a few GB (``CHUNK_WORDS``)."""
_MAX_BLOCKS = 1024
"""Blocks per chunk at most: 16 MiB chunks."""
CHUNK_WORDS = _BLOCK * _MIN_BLOCKS
"""Words per chunk (per program) where the regions come to a few GB: 4 MiB, so a GB is a
few hundred programs (and rows of partial sums). On an H200 programs of 256 KiB summed
0.6 TB/s, of 1 MiB 1.3-1.7, of 4 MiB 1.8-3.1 (``benchmarks/verify.py digest-kernel``)."""
_PROGRAMS = 1024
"""Above about this many programs of ``CHUNK_WORDS`` the chunks double (``_chunk_blocks``):
on an H200 a 16.4 GB rank took 5.2 ms in 4 MiB chunks, 4.5 in 8 and 4.4 in 16 MiB, where a
1 GB one took 0.52 ms in 4 MiB chunks and 0.63 in 8 (fewer programs than the GPU runs at
once). Each chunk length is a kernel of its own, compiled on its first use in a process
(on an engine rank of more than 4 GiB, inside its first verified pause)."""

_Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]
_LAYOUTS: LruCache[tuple[torch.device, int, tuple[int, ...]], _Layout] = LruCache(1024)
"""Chunk tables by device, stream and region sizes (the same slots come back every update: one
table per flush, so a bound above the flushes of the largest rank's update; a table
holds a few hundred bytes per GB)."""
_ADDRESSES: LruCache[tuple[torch.device, int, tuple[int, ...]], torch.Tensor] = LruCache(1024)
"""Address tables on the device by device, stream and address list (``_addresses``; 8
bytes a region)."""
_broken: list[str] = []


def usable(device: torch.device) -> bool:
    """The kernel can digest regions on ``device`` (CUDA, Triton importable, allowed, and
    not given up on in this process)."""
    return (
        device.type == "cuda"
        and not _broken
        and environment.digest_kernel_allowed()
        and _kernel() is not None
    )


def kernel_lanes(
    addresses: Sequence[int], sizes: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """The ``SUMS`` int64 sums of each region (its 8-aligned byte address and its
    length, at least 1 byte, on ``device``), as the rows of one tensor there, in the
    stream's order: nothing waits for the device but a layout's first use (its tables
    are copied there once). None where the kernel fails (then torch digests, for the
    rest of the process)."""
    if _broken:
        return None
    try:
        return _run(addresses, sizes, device)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:
        _broken.append(f"{type(exc).__name__}: {exc}")
        logger.warning("the digest kernel failed (%s); regions are digested one by one", exc)
        return None


def _run(addresses: Sequence[int], sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    # Tables kept on the device are kept per stream: once dropped, the caching allocator
    # may hand their memory to the next allocation of the stream they were made on, which
    # on another stream could come before a kernel still reading them ran
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream, tuple(sizes))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = _layout(sizes, device)
    sizes_t, chunk_region, chunk_start, bounds, blocks = layout
    addresses_t = _addresses(addresses, device, stream)
    partial = torch.zeros(len(chunk_region) + 1, SUMS, dtype=torch.int64, device=device)
    # Triton launches on the current device: switch when the regions are on another
    elsewhere = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if elsewhere else contextlib.nullcontext():
        _kernel()[(len(chunk_region),)](
            addresses_t,
            sizes_t,
            chunk_region,
            chunk_start,
            partial,
            LANES=LANES,
            BLOCK=_BLOCK,
            BLOCKS=blocks,
            num_warps=8,
        )
    sums = partial.cumsum(0)  # exact mod 2**64, like the sums themselves
    return sums[bounds[1:]] - sums[bounds[:-1]]


def _addresses(addresses: Sequence[int], device: torch.device, stream: int) -> torch.Tensor:
    """The regions' addresses as an int64 tensor on ``device``: kept per address list (a
    staging buffer's slots and an engine rank's parameters sit at the same addresses
    every update), else copied from pinned memory without waiting. A pinned block is
    reused only once the copy that read it ran: behind a busy stream the caching host
    allocator pins a new one, which took 1.5 ms of a sender's 2 ms per flush on an H200."""
    key = (device, stream, tuple(addresses))
    kept = _ADDRESSES.get(key)
    if kept is not None:
        return kept
    found = torch.tensor(addresses, dtype=torch.int64)
    if device.type == "cuda":
        found = found.pin_memory().to(device, non_blocking=True)
    _ADDRESSES[key] = found
    return found


def _chunk_blocks(sizes: Sequence[int]) -> int:
    """Blocks per chunk for these regions: ``_MIN_BLOCKS``, doubled (up to ``_MAX_BLOCKS``)
    while the regions' words would fill more than ``_PROGRAMS`` chunks."""
    words = sum(_ceil(n, 8) for n in sizes)
    blocks = _MIN_BLOCKS
    while blocks < _MAX_BLOCKS and words > _PROGRAMS * blocks * _BLOCK:
        blocks *= 2
    return blocks


def _layout(sizes: Sequence[int], device: torch.device) -> _Layout:
    """Per region its size; per chunk its region and first word; per region the number
    of chunks before it and its own (the bounds of its rows in the cumulative sum); the
    blocks per chunk."""
    blocks = _chunk_blocks(sizes)
    chunk_words = _BLOCK * blocks
    counts = torch.tensor([_ceil(_ceil(n, 8), chunk_words) for n in sizes], dtype=torch.int64)
    ends = counts.cumsum(0)
    chunk_region = torch.repeat_interleave(torch.arange(len(sizes)), counts)
    first = torch.repeat_interleave(ends - counts, counts)
    chunk_start = (torch.arange(int(ends[-1])) - first) * chunk_words
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), ends])
    return (
        torch.tensor(sizes, dtype=torch.int64).to(device),
        chunk_region.to(torch.int32).to(device),
        chunk_start.to(device),
        bounds.to(device),
        blocks,
    )


def _ceil(num: int, by: int) -> int:
    return -(-num // by)


@functools.cache
def _kernel() -> Any:
    try:
        from p2pweights.wire import _lanes_triton
    except ImportError:
        return None
    return _lanes_triton.region_lanes
