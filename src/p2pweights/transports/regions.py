"""Memory regions: which contiguous blocks hold a set of tensors, and where a write may land.

Engines register the blocks holding their weights, not each parameter: many
parameters are views into one storage, and registering each would cost one NIC
registration per tensor. Like sglang's ``register_memory_region_v2``, storages
that overlap or touch are merged into one region.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import torch

from p2pweights.errors import ConfigError


def merge_intervals(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort ``(address, num_bytes)`` intervals and merge those that overlap or touch.

    Empty intervals are dropped. The result is sorted, disjoint and non-adjacent.
    """
    merged: list[tuple[int, int]] = []
    for address, num_bytes in sorted(i for i in intervals if i[1] > 0):
        if merged and address <= merged[-1][0] + merged[-1][1]:
            start, length = merged[-1]
            merged[-1] = (start, max(start + length, address + num_bytes) - start)
        else:
            merged.append((address, num_bytes))
    return merged


def merged_regions(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """``(address, num_bytes)`` of the storage blocks holding ``tensors``, merged.

    Each tensor contributes its whole storage (a view registers the storage it
    views), so the regions also cover bytes between views. All tensors must live
    on one device: an engine rank's weights do, and one region never spans two.
    """
    devices: set[torch.device] = set()
    intervals = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        devices.add(tensor.device)
        intervals.append((storage.data_ptr(), storage.nbytes()))
    if len(devices) > 1:
        raise ConfigError(
            f"tensors live on several devices {sorted(map(str, devices))}; "
            f"register each device's tensors with its own publisher"
        )
    return merge_intervals(intervals)


class RegionIndex:
    """Finds the merged region holding a byte range (for bounds checks and device ids)."""

    def __init__(self, regions: Sequence[tuple[int, int]]) -> None:
        self._regions = merge_intervals(regions)
        self._starts = [address for address, _ in self._regions]

    def __len__(self) -> int:
        return len(self._regions)

    @property
    def regions(self) -> list[tuple[int, int]]:
        """The merged ``(address, num_bytes)`` regions, sorted."""
        return list(self._regions)

    def find(self, address: int, num_bytes: int) -> tuple[int, int] | None:
        """The region containing ``[address, address + num_bytes)``, or None if none does."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        start, length = self._regions[i]
        if address + num_bytes <= start + length:
            return start, length
        return None

    def covers(self, address: int, num_bytes: int) -> bool:
        return self.find(address, num_bytes) is not None


class RegisteredRegions:
    """Buffers registered as they were given, and their merged index: a buffer that
    borders another (two staging buffers the allocator placed side by side) is still
    removed alone, where removing it from the merged regions would find nothing."""

    def __init__(self) -> None:
        self._regions: list[tuple[int, int]] = []
        self.index = RegionIndex([])

    def add(self, address: int, num_bytes: int) -> None:
        self._regions.append((address, num_bytes))
        self.index = RegionIndex(self._regions)

    def remove(self, address: int, num_bytes: int) -> None:
        self._regions = [r for r in self._regions if r != (address, num_bytes)]
        self.index = RegionIndex(self._regions)

    def clear(self) -> None:
        self._regions = []
        self.index = RegionIndex([])


def weights_info(
    tensors: dict[str, torch.Tensor], registered: RegionIndex, *extra: int
) -> dict[str, list[int]]:
    """sglang's ``weights_info_dict``: ``{name: [data_ptr, numel, element_size, *extra]}``.

    Refuses a tensor outside ``registered`` memory: writers would be pointed at bytes
    the transport cannot reach.
    """
    table = {}
    for name, tensor in tensors.items():
        num_bytes = tensor.numel() * tensor.element_size()
        if not registered.covers(tensor.data_ptr(), num_bytes):
            raise ConfigError(f"parameter {name!r} is not in registered memory; register it first")
        table[name] = [tensor.data_ptr(), tensor.numel(), tensor.element_size(), *extra]
    return table
