"""The digest of a region of bytes, computed alike by a sender and an engine rank, CPU or GPU.

A region's bytes are read as little-endian int64 words (a tail of fewer than 8 bytes
zero-padded into one more word), laid out in rows of ``LANES`` words: word ``i`` is in
lane ``i % LANES`` of row ``i // LANES``. Two sums are kept per lane, with int64
wrap-around (exact mod 2**64):

- ``plain[lane]``: the sum of the lane's words;
- ``weighted[lane]``: the sum of each of the lane's words times its row number plus one.

Integer sums are exact and do not depend on the order of the additions, so a CPU and a
GPU, a sum over one tensor and a sum over a batch of them, the torch path and the Triton
kernel agree bit for bit. The ``2 * LANES`` sums and the region's length are then hashed
(BLAKE2b, 16 bytes) into the hex string both sides compare.

It is one read of the bytes, and it changes when a write is missing (stale bytes),
partial, lands at another offset, carries any changed word (a single word, or two words
changed in different lanes, cannot cancel), or carries the right words in the wrong
order: two words ``d`` rows apart exchanged change ``weighted`` by ``d`` times their
difference, so swapped gate and up halves, swapped experts, slices or rows (what a
wrong shard id, expert map or offset writes) are seen. What it cannot see: a change
whose plain and weighted sums both cancel mod 2**64 in every lane, such as an exchange
of two blocks ``d`` rows apart whose lane sums differ by a multiple of ``2**64 / d``'s
odd-free part (with ``d = 2**k``, lane sums equal in their low ``64 - k`` bits). It is
not a cryptographic hash of the bytes: two regions made to collide would pass, which a
transit check need not prevent. ``torch.hash_tensor`` is not used: it is an xor (equal
words cancel in pairs) and newer than some torch releases p2pweights supports.

On a GPU with Triton every 8-aligned region of a device is summed in one launch
(``lanes_kernel``). Otherwise torch sums each region in two reductions (``_lanes``), and
regions below ``SMALL_BYTES`` are concatenated (zero-padded to whole rows) and summed
per region from one cumulative sum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from p2pweights.wire import lanes_kernel

__all__ = [
    "LANES",
    "SCHEME",
    "SMALL_BYTES",
    "Lanes",
    "digest",
    "digests",
    "hex_digests",
    "lane_sums",
    "lanes_hex",
    "span_sums",
]

LANES = lanes_kernel.LANES
"""Word ``i`` of a region is summed into lane ``i % LANES`` of row ``i // LANES``."""
SUMS = lanes_kernel.SUMS
"""Sums per region: ``LANES`` plain, then ``LANES`` weighted by row."""
SCHEME = "lanes16-rows-v2"
"""The digest's definition, named: an engine rank records it beside its digests, and a
sender refuses to compare digests made another way (a p2pweights release apart)."""
_ROW_BYTES = LANES * 8
_ROW_SUMS_BYTES = SUMS * 8
"""One region's sums as little-endian int64 bytes: what is hashed, with its length."""
_BLOCK_ROWS = 1024
"""Rows per block of ``_lanes``' two reductions (128 KiB)."""
SMALL_BYTES = 256 * 1024
"""Regions below this are digested together (one launch per batch, not per region)."""


@dataclass(frozen=True)
class Lanes:
    """One region's sums: row ``row`` of ``rows`` (int64, ``SUMS`` columns, on the region's
    device: the sums of a batch of regions stay one tensor), and its length."""

    rows: torch.Tensor
    row: int
    num_bytes: int


def digest(region: torch.Tensor) -> str:
    """The digest of ``region``'s bytes (any dtype, contiguous)."""
    return digests({"": region})[""]


def digests(regions: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Name -> digest of each region's bytes; one copy to the host for all of them."""
    return hex_digests(lane_sums(regions))


def lane_sums(regions: Mapping[str, torch.Tensor]) -> dict[str, Lanes]:
    """Name -> its region's ``Lanes``, computed in the stream's order: regions the kernel
    takes wait for nothing (but the first use of a layout, whose tables are copied to
    the device once); a batch of small regions left to torch waits for the stream once,
    to hand its bounds to the device."""
    found: dict[str, Lanes] = {}
    small: dict[torch.device, dict[str, torch.Tensor]] = {}
    by_kernel: dict[torch.device, dict[str, torch.Tensor]] = {}
    usable: dict[torch.device, bool] = {}

    def by_torch(name: str, tensor: torch.Tensor) -> None:
        data = _as_bytes(tensor)
        if data.numel() < SMALL_BYTES:
            small.setdefault(data.device, {})[name] = data
        else:
            found[name] = Lanes(_lanes(data).view(1, SUMS), 0, data.numel())

    for name, tensor in regions.items():
        device = tensor.device
        if device not in usable:
            usable[device] = lanes_kernel.usable(device)
        if (
            usable[device]
            and tensor.numel()
            and tensor.is_contiguous()
            and tensor.data_ptr() % 8 == 0
        ):
            by_kernel.setdefault(device, {})[name] = tensor
        else:
            by_torch(name, tensor)
    for device, batch in by_kernel.items():
        spans = {n: (t.data_ptr(), t.numel() * t.element_size()) for n, t in batch.items()}
        summed = _kernel_sums(spans, device)
        found.update(summed)
        for name, tensor in batch.items():
            if name not in summed:  # the kernel failed: torch, as for any region
                by_torch(name, tensor)
    for batch in small.values():
        rows = _batched_lanes(batch)
        found.update(
            (name, Lanes(rows, i, data.numel())) for i, (name, data) in enumerate(batch.items())
        )
    return {name: found[name] for name in regions}


def span_sums(buffer: torch.Tensor, spans: Mapping[str, tuple[int, int]]) -> dict[str, Lanes]:
    """``lane_sums`` of regions of one contiguous tensor, each given as (byte offset, byte
    length): where the kernel runs, read at their addresses, with no tensor view made
    per region (a sender digests every slot of a staging buffer this way)."""
    found: dict[str, Lanes] = {}
    base = buffer.data_ptr()
    if buffer.is_contiguous() and lanes_kernel.usable(buffer.device):
        aligned = {
            name: (base + offset, size)
            for name, (offset, size) in spans.items()
            if size and (base + offset) % 8 == 0
        }
        found.update(_kernel_sums(aligned, buffer.device))
    flat = buffer.reshape(-1).view(torch.uint8)
    rest = {n: flat[o : o + size] for n, (o, size) in spans.items() if n not in found}
    found.update(lane_sums(rest))
    return {name: found[name] for name in spans}


def _kernel_sums(spans: Mapping[str, tuple[int, int]], device: torch.device) -> dict[str, Lanes]:
    """The kernel's ``Lanes`` of regions given as (8-aligned address, length > 0) on
    ``device``, in one launch; empty where there are none or the kernel failed."""
    if not spans:
        return {}
    sizes = [size for _, size in spans.values()]
    rows = lanes_kernel.kernel_lanes([address for address, _ in spans.values()], sizes, device)
    if rows is None:
        return {}
    return {
        name: Lanes(rows, i, size) for i, (name, size) in enumerate(zip(spans, sizes, strict=True))
    }


def hex_digests(sums: Mapping[str, Lanes]) -> dict[str, str]:
    """The digests of ``lane_sums``' results: one copy to the host per device, and each
    region's sums hashed from one byte string (no array per region)."""
    tensors: dict[int, torch.Tensor] = {id(lanes.rows): lanes.rows for lanes in sums.values()}
    by_device: dict[torch.device, list[int]] = {}
    for key, rows in tensors.items():
        by_device.setdefault(rows.device, []).append(key)
    first: dict[int, int] = {}
    on_host: dict[int, memoryview] = {}
    for keys in by_device.values():
        host = torch.cat([tensors[k] for k in keys]).cpu().numpy().astype("<i8", copy=False)
        data = memoryview(host.tobytes())
        at = 0
        for key in keys:
            first[key], on_host[key] = at, data
            at += len(tensors[key]) * _ROW_SUMS_BYTES
    return {
        name: _hashed(
            on_host[id(lanes.rows)][
                first[id(lanes.rows)] + lanes.row * _ROW_SUMS_BYTES : first[id(lanes.rows)]
                + (lanes.row + 1) * _ROW_SUMS_BYTES
            ],
            lanes.num_bytes,
        )
        for name, lanes in sums.items()
    }


def lanes_hex(lanes: torch.Tensor, num_bytes: int) -> str:
    """The hex digest of one region's ``SUMS`` int64 sums and its length."""
    return _hashed(lanes.contiguous().numpy().astype("<i8").tobytes(), num_bytes)


def _hashed(lane_bytes: bytes | memoryview, num_bytes: int) -> str:
    hasher = hashlib.blake2b(lane_bytes, digest_size=16)
    hasher.update(num_bytes.to_bytes(8, "little"))
    return hasher.hexdigest()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view where possible)."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


def _lanes(data: torch.Tensor) -> torch.Tensor:
    """The ``SUMS`` sums of ``data`` (uint8, at least one row).

    The whole rows (a view where the bytes are 8-aligned, else a copy) are read as a
    ``(blocks, _BLOCK_ROWS, LANES)`` block, reduced once over ``blocks`` and once over the
    rows of a block; with row ``r = b * _BLOCK_ROWS + j``, the weighted sum is
    ``_BLOCK_ROWS * sum_b b * S1[b] + sum_j (j + 1) * S2[j]``: two reductions of the data
    and no temporary as large as it. Rows past the last whole block and a last partial
    row (zero-padded) are added on their own."""
    num_rows = data.numel() // _ROW_BYTES
    head = data[: num_rows * _ROW_BYTES]
    if head.data_ptr() % 8:
        head = head.clone()
    rows = head.view(torch.int64).view(-1, LANES)
    num_blocks = num_rows // _BLOCK_ROWS
    blocked = rows[: num_blocks * _BLOCK_ROWS].view(num_blocks, _BLOCK_ROWS, LANES)
    by_block = blocked.sum(dim=1, dtype=torch.int64)  # S1: (blocks, LANES)
    by_row = blocked.sum(dim=0, dtype=torch.int64)  # S2: (_BLOCK_ROWS, LANES)
    device = data.device
    block_index = torch.arange(num_blocks, dtype=torch.int64, device=device).view(-1, 1)
    row_weight = torch.arange(1, _BLOCK_ROWS + 1, dtype=torch.int64, device=device).view(-1, 1)
    plain = by_row.sum(dim=0)
    weighted = _BLOCK_ROWS * (by_block * block_index).sum(dim=0) + (by_row * row_weight).sum(0)
    rest = rows[num_blocks * _BLOCK_ROWS :]
    if data.numel() > num_rows * _ROW_BYTES:  # the last row, zero-padded
        last = torch.zeros(_ROW_BYTES, dtype=torch.uint8, device=device)
        last[: data.numel() - num_rows * _ROW_BYTES] = data[num_rows * _ROW_BYTES :]
        rest = torch.cat([rest, last.view(torch.int64).view(1, LANES)])
    if len(rest):
        first_row = num_blocks * _BLOCK_ROWS
        weights = torch.arange(first_row + 1, first_row + len(rest) + 1, device=device)
        plain = plain + rest.sum(dim=0)
        weighted = weighted + (rest * weights.view(-1, 1)).sum(dim=0)
    return torch.cat([plain, weighted])


def _batched_lanes(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Sums of many small regions of one device (rows, in ``batch``'s order) from one
    concatenation and two cumulative sums: with ``g`` a row's number in the
    concatenation and ``s`` its region's first, its weight ``g - s + 1`` splits into
    ``g``, summed into one cumulative sum, and ``1 - s`` times the plain sum."""
    device = next(iter(batch.values())).device
    zeros = torch.zeros(_ROW_BYTES, dtype=torch.uint8, device=device)
    pieces, ends, end = [], [], 0
    for data in batch.values():
        pad = -data.numel() % _ROW_BYTES
        pieces.append(data)
        if pad:
            pieces.append(zeros[:pad])
        end += (data.numel() + pad) // _ROW_BYTES
        ends.append(end)
    rows = torch.cat(pieces).view(torch.int64).view(-1, LANES)
    row_number = torch.arange(len(rows), dtype=torch.int64, device=device).view(-1, 1)
    both = torch.cat([rows, rows * row_number], dim=1)
    sums = torch.cat([torch.zeros(1, SUMS, dtype=torch.int64, device=device), both.cumsum(0)])
    bounds = torch.tensor([0, *ends], device=device)
    per_region = sums[bounds[1:]] - sums[bounds[:-1]]  # exact mod 2**64, like the sums
    plain, by_number = per_region[:, :LANES], per_region[:, LANES:]
    first = bounds[:-1].view(-1, 1)
    return torch.cat([plain, by_number + (1 - first) * plain], dim=1)
