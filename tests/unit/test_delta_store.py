"""The sender's previous bytes: per layout, which engine ranks hold them, forgetting."""

from __future__ import annotations

import torch

from p2pweights.delta.store import PreviousBytes

A, B = ("http://a", 0), ("http://b", 1)


def _bf16(values: list[float]) -> torch.Tensor:
    return torch.tensor(values * 64, dtype=torch.bfloat16).view(torch.uint8)


def test_first_update_has_nothing_to_delta_against_and_sizes_are_reported():
    store = PreviousBytes()
    new = _bf16([1.0, 2.0])
    assert store.delta("layout", "w", new, 2) is None
    store.remember("layout", "w", new)
    store.remember("other-layout", "w", new)  # each layout once
    assert store.num_bytes == 2 * new.numel()
    assert not store.holds(A)  # no update finished yet
    store.finish(store.next_sequence(), [A, B])
    assert store.holds(A) and store.holds(B)


def test_delta_against_the_stored_bytes_then_those_are_replaced():
    store = PreviousBytes()
    first = _bf16([1.0] * 16)
    store.remember("k", "w", first)
    store.finish(1, [A])
    second = first.clone()
    second.view(torch.bfloat16)[:5] = 2.0
    entry = store.delta("k", "w", second, 2)
    assert entry is not None and entry.count == 5
    store.remember("k", "w", second)
    entry = store.delta("k", "w", second, 2)
    assert entry is not None and entry.count == 0
    assert store.delta("k", "w", _bf16([1.0]), 2) is None  # another size: full


def test_stored_bytes_are_copies_not_views_of_the_staging_buffer():
    store = PreviousBytes()
    staging = _bf16([1.0] * 16)
    store.remember("k", "w", staging)
    staging.view(torch.bfloat16)[:3] = 0.0  # the buffer is refilled by the next group
    entry = store.delta("k", "w", staging, 2)
    assert entry is not None and entry.count == 3


def test_forgetting_a_rank_or_everything():
    store = PreviousBytes()
    store.remember("k", "w", _bf16([1.0]))
    first = store.next_sequence()
    store.finish(first, [A, B])
    assert store.next_sequence() > first
    store.forget_target(B)  # its publication changed
    assert store.holds(A) and not store.holds(B)
    store.finish(store.next_sequence(), [A])  # B's writes failed in this one
    assert not store.holds(B)
    store.forget()  # an update failed
    assert not store.holds(A) and store.num_bytes == 0 and store.sequence == 0
    assert store.delta("k", "w", _bf16([1.0]), 2) is None


def test_host_copies_of_device_staging():
    store = PreviousBytes(torch.device("cpu"))
    new = _bf16([1.0] * 16)
    store.remember("k", "w", new)
    assert store.num_bytes == new.numel() and store._slots[("k", "w")].device.type == "cpu"
    changed = new.clone()
    changed.view(torch.bfloat16)[7] = 4.0
    entry = store.delta("k", "w", changed, 2)
    assert entry is not None and entry.count == 1
