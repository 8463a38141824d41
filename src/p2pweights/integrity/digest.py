"""The digest of a region of bytes, computed alike by a sender and an engine rank, CPU or GPU.

A region's bytes are read as little-endian int64 words (a tail of fewer than 8 bytes
zero-padded into one more word) and summed into ``LANES`` lanes, word ``i`` into lane
``i % LANES``, with int64 wrap-around. Integer sums are exact and do not depend on the
order of the additions, so a CPU and a GPU, or a sum over one tensor and a sum over
a batch of them, agree bit for bit. The lanes and the region's length are then hashed
(BLAKE2b, 16 bytes) into the hex string both sides compare.

It is one read of the bytes, and it changes when a write is missing (stale bytes),
partial, lands at another offset (unless the bytes it replaced repeat with the
shift's period, in each lane), or carries any changed word (a single word, or two
words changed in different lanes, cannot cancel). It is not a cryptographic hash of
the bytes: two regions made to collide would pass, which a transit check need not
prevent. ``torch.hash_tensor`` is not used: it is an xor (equal words cancel in
pairs) and newer than some torch releases p2pweights supports.

On a GPU with Triton every 8-aligned region of a device is summed in one launch
(``lanes_kernel``). Otherwise each region costs a launch or more: below ``SMALL_BYTES``
they are concatenated (zero-padded to whole rows of ``LANES`` words) and summed per
region from one cumulative sum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from p2pweights.integrity import lanes_kernel

__all__ = [
    "LANES",
    "SMALL_BYTES",
    "Lanes",
    "digest",
    "digests",
    "hex_digests",
    "lane_sums",
    "lanes_hex",
]

LANES = lanes_kernel.LANES
"""Word ``i`` of a region is summed into lane ``i % LANES``."""
_ROW_BYTES = LANES * 8
SMALL_BYTES = 256 * 1024
"""Regions below this are digested together (one launch per batch, not per region)."""


@dataclass(frozen=True)
class Lanes:
    """One region's lane sums: row ``row`` of ``rows`` (int64, ``LANES`` columns, on the
    region's device: the sums of a batch of regions stay one tensor), and its length."""

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
            found[name] = Lanes(_lanes(data).view(1, LANES), 0, data.numel())

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
        sizes = [t.numel() * t.element_size() for t in batch.values()]
        rows = lanes_kernel.kernel_lanes([t.data_ptr() for t in batch.values()], sizes, device)
        if rows is None:  # the kernel failed: torch, as for any region
            for name, tensor in batch.items():
                by_torch(name, tensor)
        else:
            found.update(
                (name, Lanes(rows, i, size))
                for i, (name, size) in enumerate(zip(batch, sizes, strict=True))
            )
    for batch in small.values():
        rows = _batched_lanes(batch)
        found.update(
            (name, Lanes(rows, i, data.numel())) for i, (name, data) in enumerate(batch.items())
        )
    return {name: found[name] for name in regions}


def hex_digests(sums: Mapping[str, Lanes]) -> dict[str, str]:
    """The digests of ``lane_sums``' results: one copy to the host per device."""
    tensors: dict[int, torch.Tensor] = {id(lanes.rows): lanes.rows for lanes in sums.values()}
    by_device: dict[torch.device, list[int]] = {}
    for key, rows in tensors.items():
        by_device.setdefault(rows.device, []).append(key)
    first: dict[int, int] = {}
    on_host: dict[int, Any] = {}
    for keys in by_device.values():
        host = torch.cat([tensors[k] for k in keys]).cpu().numpy().astype("<i8", copy=False)
        at = 0
        for key in keys:
            first[key], on_host[key] = at, host
            at += len(tensors[key])
    return {
        name: _hashed(
            on_host[id(lanes.rows)][first[id(lanes.rows)] + lanes.row].tobytes(), lanes.num_bytes
        )
        for name, lanes in sums.items()
    }


def lanes_hex(lanes: torch.Tensor, num_bytes: int) -> str:
    """The hex digest of one region's ``LANES`` int64 sums and its length."""
    return _hashed(lanes.contiguous().numpy().astype("<i8").tobytes(), num_bytes)


def _hashed(lane_bytes: bytes, num_bytes: int) -> str:
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
    """The ``LANES`` sums of ``data`` (uint8, at least one row): one reduction over its
    whole rows (a view where the bytes are 8-aligned, else a copy), plus the rest
    zero-padded to one row where the length is not a whole number of rows."""
    num_full = data.numel() // _ROW_BYTES * _ROW_BYTES
    head = data[:num_full]
    if head.data_ptr() % 8:
        head = head.clone()
    sums = head.view(torch.int64).view(-1, LANES).sum(dim=0, dtype=torch.int64)
    if num_full == data.numel():
        return sums
    rest = torch.zeros(_ROW_BYTES, dtype=torch.uint8, device=data.device)
    rest[: data.numel() - num_full] = data[num_full:]
    return sums + rest.view(torch.int64)


def _batched_lanes(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Lanes of many small regions of one device (rows, in ``batch``'s order) from one
    concatenation and cumsum."""
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
    sums = torch.cat([torch.zeros(1, LANES, dtype=torch.int64, device=device), rows.cumsum(0)])
    bounds = torch.tensor([0, *ends], device=device)
    return sums[bounds[1:]] - sums[bounds[:-1]]  # exact mod 2**64, like the sums
