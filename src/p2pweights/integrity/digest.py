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

import torch

from p2pweights.integrity import lanes_kernel

__all__ = ["LANES", "SMALL_BYTES", "digest", "digests", "hex_digests", "lane_sums", "lanes_hex"]

LANES = 16
"""Word ``i`` of a region is summed into lane ``i % LANES``."""
_ROW_BYTES = LANES * 8
SMALL_BYTES = 256 * 1024
"""Regions below this are digested together (one launch per batch, not per region)."""


def digest(region: torch.Tensor) -> str:
    """The digest of ``region``'s bytes (any dtype, contiguous)."""
    return digests({"": region})[""]


def digests(regions: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Name -> digest of each region's bytes; one copy to the host for all of them."""
    return hex_digests(lane_sums(regions))


def lane_sums(regions: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """Name -> (its ``LANES`` sums, on the region's device; its length in bytes). On a GPU
    nothing waits for the device: the sums are ready once the stream reaches them."""
    flat = {name: _as_bytes(t) for name, t in regions.items()}
    lanes: dict[str, torch.Tensor] = {}
    small: dict[torch.device, dict[str, torch.Tensor]] = {}
    by_kernel: dict[torch.device, dict[str, torch.Tensor]] = {}

    def by_torch(name: str, data: torch.Tensor) -> None:
        if data.numel() < SMALL_BYTES:
            small.setdefault(data.device, {})[name] = data
        else:
            lanes[name] = _lanes(data)

    usable: dict[torch.device, bool] = {}
    for name, data in flat.items():
        device = data.device
        if device not in usable:
            usable[device] = lanes_kernel.usable(device)
        if usable[device] and data.numel() and data.data_ptr() % 8 == 0:
            by_kernel.setdefault(device, {})[name] = data
        else:
            by_torch(name, data)
    for batch in by_kernel.values():
        sums = lanes_kernel.kernel_lanes(list(batch.values()), LANES)
        if sums is None:  # the kernel failed: torch, as for any region
            for name, data in batch.items():
                by_torch(name, data)
        else:
            lanes.update(zip(batch, sums.unbind(0), strict=True))
    for batch in small.values():
        lanes.update(_batched_lanes(batch))
    return {name: (lanes[name], flat[name].numel()) for name in flat if name in lanes}


def hex_digests(sums: Mapping[str, tuple[torch.Tensor, int]]) -> dict[str, str]:
    """The digests of ``lane_sums``' results: one copy to the host per device."""
    by_device: dict[torch.device, list[str]] = {}
    for name, (lanes, _) in sums.items():
        by_device.setdefault(lanes.device, []).append(name)
    found: dict[str, str] = {}
    for names in by_device.values():
        rows = torch.stack([sums[n][0] for n in names]).cpu().numpy().astype("<i8", copy=False)
        for name, row in zip(names, rows, strict=True):
            found[name] = _hashed(row.tobytes(), sums[name][1])
    return {name: found[name] for name in sums}


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


def _batched_lanes(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Lanes of many small regions of one device from one concatenation and cumsum."""
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
    per_region = sums[bounds[1:]] - sums[bounds[:-1]]  # exact mod 2**64, like the sums
    return {name: per_region[i] for i, name in enumerate(batch)}
