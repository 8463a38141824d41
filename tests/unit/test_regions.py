"""Which memory blocks engines register, and where writes may land."""

from __future__ import annotations

import pytest
import torch

from p2pweights.errors import ConfigError
from p2pweights.transports.regions import (
    RegionIndex,
    RegisteredRegions,
    merge_intervals,
    merged_regions,
)


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([], []),
        ([(100, 0)], []),
        ([(100, 10)], [(100, 10)]),
        ([(100, 10), (110, 5)], [(100, 15)]),  # adjacent
        ([(100, 10), (105, 20)], [(100, 25)]),  # overlapping
        ([(100, 50), (110, 5)], [(100, 50)]),  # contained
        ([(200, 10), (100, 10)], [(100, 10), (200, 10)]),  # unsorted, disjoint
        ([(100, 10), (111, 5)], [(100, 10), (111, 5)]),  # one-byte gap stays apart
        ([(300, 5), (100, 100), (200, 100), (50, 0)], [(100, 205)]),
    ],
)
def test_merge_intervals(intervals: list[tuple[int, int]], expected: list[tuple[int, int]]) -> None:
    assert merge_intervals(intervals) == expected


def test_views_of_one_storage_are_one_region() -> None:
    flat = torch.zeros(1000, dtype=torch.float32)
    separate = torch.zeros(10, dtype=torch.bfloat16)
    tensors = [flat[:100].view(10, 10), flat[500:600], flat[100:500], separate]
    expected = merge_intervals([(flat.data_ptr(), 4000), (separate.data_ptr(), 20)])
    assert merged_regions(tensors) == expected


def test_a_view_registers_its_whole_storage() -> None:
    flat = torch.zeros(256, dtype=torch.uint8)
    assert merged_regions([flat[10:20]]) == [(flat.data_ptr(), 256)]


def test_tensors_on_several_devices_are_refused() -> None:
    with pytest.raises(ConfigError, match="several devices"):
        merged_regions([torch.zeros(4), torch.zeros(4, device="meta")])


@pytest.mark.parametrize(
    ("address", "num_bytes", "found"),
    [
        (100, 10, (100, 15)),
        (104, 11, (100, 15)),
        (104, 12, None),  # runs past the end
        (99, 2, None),  # starts before
        (200, 10, (200, 10)),
        (115, 1, None),  # in the gap
        (0, 1, None),
    ],
)
def test_region_index_find(address: int, num_bytes: int, found: tuple[int, int] | None) -> None:
    index = RegionIndex([(110, 5), (100, 10), (200, 10)])
    assert index.find(address, num_bytes) == found
    assert index.covers(address, num_bytes) == (found is not None)
    assert index.regions == [(100, 15), (200, 10)]


def test_a_registered_buffer_bordering_another_is_removed_alone():
    """Two staging buffers the allocator placed side by side merge in the index; removing
    one must still remove it (a source removed from nothing stayed registered before)."""
    registered = RegisteredRegions()
    registered.add(1000, 500)
    registered.add(1500, 500)  # borders the first: one merged region
    assert registered.index.regions == [(1000, 1000)]
    registered.remove(1500, 500)
    assert registered.index.regions == [(1000, 500)]
    assert not registered.index.covers(1500, 1)
    registered.clear()
    assert registered.index.regions == []
