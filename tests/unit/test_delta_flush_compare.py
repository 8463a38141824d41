"""A flush compared in one pass gives every slot the entry ``wire.encode`` gives it alone."""

from __future__ import annotations

import pytest
import torch

from p2pweights.delta.flush_compare import FlushSlot, encode_flush
from p2pweights.delta.store import FlushLayout, PreviousBytes
from p2pweights.plan.byte_plan import aligned
from p2pweights.wire.delta import encode

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
    ),
]


def _flush(sizes: list[tuple[int, int]]) -> tuple[list[FlushSlot], int]:
    """Slots of (elements, element size) at 256-aligned offsets, as a staging flush."""
    slots, offset = [], 0
    for index, (count, elem_size) in enumerate(sizes):
        slots.append(FlushSlot(offset, count * elem_size, elem_size, index))
        offset += aligned(count * elem_size)
    return slots, offset


def _changed(
    previous: torch.Tensor,
    slots: list[FlushSlot],
    fractions: list[float],
    generator: torch.Generator,
) -> torch.Tensor:
    """``previous`` with about ``fraction`` of each slot's elements given new random bytes,
    and the padding between slots changed too (it belongs to no slot)."""
    new = torch.randint(0, 256, previous.shape, dtype=torch.uint8, generator=generator)
    for slot, fraction in zip(slots, fractions, strict=True):
        old = previous[slot.offset : slot.offset + slot.num_bytes]
        part = new[slot.offset : slot.offset + slot.num_bytes]
        keep = torch.rand(slot.num_bytes // slot.elem_size, generator=generator) >= fraction
        keep = keep.repeat_interleave(slot.elem_size)
        part[keep] = old[keep]
    return new


@pytest.mark.parametrize("max_fraction", [0.9, 0.3, 0.04])
@pytest.mark.parametrize("device", DEVICES)
def test_every_slot_gets_the_entry_encode_gives_it_alone(device: str, max_fraction: float) -> None:
    generator = torch.Generator().manual_seed(7)
    # bf16 weights, fp32 scales, fp8 blocks, int64 ids; odd lengths; one slot unchanged,
    # one nearly all changed (a full write), one with a single change
    sizes = [(4099, 2), (37, 4), (1001, 1), (65, 8), (3000, 2), (513, 2), (2048, 2)]
    fractions = [0.03, 0.2, 0.05, 0.5, 0.0, 0.95, 1 / 2048]
    slots, num_bytes = _flush(sizes)
    previous = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator)
    new = _changed(previous, slots, fractions, generator)
    previous, new = previous.to(device), new.to(device)

    entries = encode_flush(previous, new, slots, max_fraction=max_fraction)

    for slot, entry in zip(slots, entries, strict=True):
        part = slice(slot.offset, slot.offset + slot.num_bytes)
        alone = encode(
            previous[part],
            new[part],
            slot.elem_size,
            param_index=slot.param_index,
            max_fraction=max_fraction,
        )
        if alone is None:
            assert entry is None, slot
            continue
        assert entry is not None, slot
        assert (entry.param_index, entry.elem_size, entry.param_bytes) == (
            alone.param_index,
            alone.elem_size,
            alone.param_bytes,
        )
        assert torch.equal(entry.indices.cpu(), alone.indices.cpu()), slot
        assert torch.equal(entry.values.cpu(), alone.values.cpu()), slot
    assert entries[4] is not None and entries[4].count == 0  # unchanged
    assert entries[5] is None  # 95 % changed, over max_fraction
    assert entries[6] is not None and entries[6].count >= 1


def test_refuses_a_range_not_of_whole_aligned_words() -> None:
    data = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="8-byte words"):
        encode_flush(data[:60], data[:60].clone(), [FlushSlot(0, 60, 2)])
    with pytest.raises(ValueError, match="not in the range"):
        encode_flush(data, data.clone(), [FlushSlot(8, 60, 2)])
    with pytest.raises(ValueError, match="slots ascend"):
        encode_flush(data, data.clone(), [FlushSlot(16, 8, 2), FlushSlot(0, 8, 2)])


def _store_flush(store: PreviousBytes, position: int, params: dict[str, torch.Tensor]):
    """Stage ``params`` (bf16) as one flush and compare it; returns the entries by name."""
    offsets, offset = {}, 0
    for name, tensor in params.items():
        offsets[name] = offset
        offset += aligned(tensor.numel() * 2)
    flush = torch.zeros(offset, dtype=torch.uint8)
    for name, tensor in params.items():
        flush[offsets[name] : offsets[name] + tensor.numel() * 2] = tensor.view(torch.uint8)
    layout = FlushLayout(
        tuple(("k", n, offsets[n], t.numel() * 2) for n, t in params.items()), offset
    )
    compare = [
        FlushSlot(offsets[n], t.numel() * 2, 2, i) for i, (n, t) in enumerate(params.items())
    ]
    entries = store.compare_flush(position, layout, flush, compare)
    return dict(zip(params, entries, strict=True))


def test_the_store_compares_a_flush_laid_out_as_before_or_slot_by_slot() -> None:
    generator = torch.Generator().manual_seed(3)
    params = {
        n: torch.randn(700 + 13 * i, generator=generator).bfloat16() for i, n in enumerate("abcd")
    }
    store = PreviousBytes()
    first = {
        **_store_flush(store, 0, {"a": params["a"], "b": params["b"]}),
        **_store_flush(store, 1, {"c": params["c"], "d": params["d"]}),
    }
    assert all(entry is None for entry in first.values())  # nothing stored yet
    store.finish(1, [], num_flushes=2)

    for step in range(3):
        changed = {n: t.clone() for n, t in params.items()}
        for t in changed.values():
            t[step::97] += 1.0
        if step == 1:  # laid out otherwise: b moved to the second flush
            flushes = [
                {"a": changed["a"]},
                {"b": changed["b"], "c": changed["c"], "d": changed["d"]},
            ]
        else:
            flushes = [
                {"a": changed["a"], "b": changed["b"]},
                {"c": changed["c"], "d": changed["d"]},
            ]
        entries = {}
        for position, flush in enumerate(flushes):
            entries.update(_store_flush(store, position, flush))
        store.finish(step + 2, [], num_flushes=2)
        for n, t in changed.items():
            expected = (
                torch.ne(params[n].view(torch.int16), t.view(torch.int16)).nonzero().flatten()
            )
            assert torch.equal(entries[n].indices.long(), expected), (step, n)
        params = changed
    assert store.num_bytes >= sum(t.numel() * 2 for t in params.values())


def test_the_store_counts_what_it_holds_and_drops_what_is_no_longer_staged() -> None:
    a, b = torch.ones(1000).bfloat16(), torch.ones(128).bfloat16()
    store = PreviousBytes()
    _store_flush(store, 0, {"a": a, "b": b})
    store.finish(1, [], num_flushes=1)
    both = store.num_bytes
    assert both == aligned(2000) + aligned(256)
    # b moves to a flush of its own: until it is staged, its bytes are in the old image
    _store_flush(store, 0, {"a": a})
    assert store.num_bytes == both + aligned(2000)  # the old image, held for b
    _store_flush(store, 1, {"b": b})
    assert store.num_bytes == aligned(2000) + aligned(256)  # the old image let go
    store.finish(2, [], num_flushes=2)
    _store_flush(store, 0, {"a": a})  # b is no longer sent
    store.finish(3, [], num_flushes=1)
    assert store.num_bytes == aligned(2000)
