"""The delta entries of every slot of one staging flush, from one comparison of the flush.

``wire.encode`` compares one parameter: on a GPU each call waits for the device twice
(``nonzero`` and a boolean index need their sizes on the host), so a flush of a few
hundred slots spent most of its time waiting (about 0.4 ms a slot on an H200). Here
the flush's bytes are compared with the previous update's image of the same bytes in
one pass, and every slot's entry is cut from the result: a fixed number of waits per
flush and per element size, whatever the number of slots.

The flush is a range of the staging buffer (8-aligned, whole 8-byte words) holding
slots at offsets from its start; bytes between slots (alignment padding) are compared
too but belong to no slot and are dropped. An entry is the same as ``wire.encode``
makes of the slot alone (the tests compare them), including where it gives None.

Where most elements changed (a large learning rate) nearly every word differs, and
finding each changed element of every word costs far more than the compare itself
(35 s against 1.3 s for 100 MB at 60 % and 2 % changed, on the loaded 2-core machine):
the changed words of each slot are counted first, a slot with more of them than a delta
can take (``max_fraction``, or an entry no smaller than the slot) is given None there,
and only the other slots' elements are looked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2pweights.wire.delta import MAX_ELEMENTS, DeltaEntry, entry_bytes, typed

__all__ = ["FlushSlot", "encode_flush"]


@dataclass(frozen=True)
class FlushSlot:
    """One slot of a flush: where its bytes start in the range, and how to compare them."""

    offset: int
    """From the range's start; a multiple of 8."""
    num_bytes: int
    elem_size: int
    """1, 2, 4 or 8."""
    param_index: int = 0


def encode_flush(
    previous: torch.Tensor,
    new: torch.Tensor,
    slots: Sequence[FlushSlot],
    *,
    max_fraction: float = 1.0,
) -> list[DeltaEntry | None]:
    """Per slot (ascending offsets), the entry turning its bytes in ``previous`` into
    those in ``new`` (flat uint8 tensors of one size, a multiple of 8, 8-aligned, one
    device), or None where ``wire.encode`` gives None (a full write is no larger, too
    many elements changed, too many elements for int32 indices, or bytes that are not
    whole elements)."""
    if previous.shape != new.shape or previous.dtype != torch.uint8 or new.dtype != torch.uint8:
        raise ValueError("previous and new must be flat uint8 tensors of one size")
    if new.numel() % 8 or new.data_ptr() % 8 or previous.data_ptr() % 8:
        raise ValueError("a flush is compared in whole, aligned 8-byte words")
    end = 0
    for slot in slots:
        if slot.offset % 8 or slot.offset < end or slot.offset + slot.num_bytes > new.numel():
            raise ValueError(
                f"slot at {slot.offset} ({slot.num_bytes} bytes) is not in the range after the "
                f"slot before it (slots ascend, do not overlap and start 8-aligned)"
            )
        end = slot.offset + slot.num_bytes
        typed(new[:0], slot.elem_size)  # 1, 2, 4 or 8
    device = new.device
    differ = torch.ne(previous.view(torch.int64), new.view(torch.int64))
    full = _too_many_changed(previous, new, differ, slots, max_fraction)
    for i in full:  # no element of theirs is looked for
        differ[slots[i].offset // 8 : -(-(slots[i].offset + slots[i].num_bytes) // 8)] = False
    words = differ.nonzero().flatten()
    starts = torch.tensor([s.offset for s in slots], dtype=torch.int64, device=device)
    found: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(slots)
    for elem_size in sorted({s.elem_size for s in slots}):
        members = [i for i, s in enumerate(slots) if s.elem_size == elem_size]
        indices, values, counts = _changed_of_size(
            previous, new, words, starts, slots, members, elem_size
        )
        begin = 0
        for i, count in zip(members, counts, strict=True):
            found[i] = (
                indices[begin : begin + count],
                values[begin : begin + count].view(torch.uint8),
            )
            begin += count
    entries: list[DeltaEntry | None] = []
    for i, (slot, (indices, values)) in enumerate(zip(slots, found, strict=True)):  # type: ignore[misc]
        entries.append(None if i in full else _entry(slot, indices, values, max_fraction))
    return entries


def _too_many_changed(
    previous: torch.Tensor,
    new: torch.Tensor,
    differ: torch.Tensor,
    slots: Sequence[FlushSlot],
    max_fraction: float,
) -> set[int]:
    """The slots ``_entry`` would give None for their number of changed elements alone:
    bounded by the changed words wholly inside each (at least one element each, at most
    a word's), and counted element by element only where the bounds do not decide."""
    if not slots:
        return set()

    def too_many(slot: FlushSlot, count: int) -> bool:
        return (
            count > max_fraction * (slot.num_bytes // slot.elem_size)
            or entry_bytes(count, slot.elem_size) >= slot.num_bytes
        )

    words = torch.stack(
        [differ[s.offset // 8 : (s.offset + s.num_bytes) // 8].sum() for s in slots]
    ).tolist()
    full, unsure = set(), []
    for i, (slot, num_words) in enumerate(zip(slots, words, strict=True)):
        per_word = 8 // slot.elem_size
        most = num_words * per_word + (per_word if slot.num_bytes % 8 else 0)
        if slot.num_bytes % slot.elem_size or slot.num_bytes // slot.elem_size > MAX_ELEMENTS:
            continue  # ``_entry`` gives None whatever changed
        if too_many(slot, num_words):
            full.add(i)
        elif too_many(slot, most):
            unsure.append(i)
    if unsure:
        counts = torch.stack(
            [
                torch.ne(
                    typed(previous[slots[i].offset : slots[i].offset + slots[i].num_bytes], e),
                    typed(new[slots[i].offset : slots[i].offset + slots[i].num_bytes], e),
                ).sum()
                for i in unsure
                for e in (slots[i].elem_size,)
            ]
        ).tolist()
        full.update(i for i, count in zip(unsure, counts, strict=True) if too_many(slots[i], count))
    return full


def _changed_of_size(
    previous: torch.Tensor,
    new: torch.Tensor,
    words: torch.Tensor,
    starts: torch.Tensor,
    slots: Sequence[FlushSlot],
    members: list[int],
    elem_size: int,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The changed elements of the slots ``members`` (all of ``elem_size`` bytes): their
    indices in their slot (int32), their new values (elements of ``elem_size`` bytes), both
    grouped by slot in ``members``' order, and how many each slot has."""
    device = new.device
    if len(members) < len(slots):  # only the words of this size's slots
        sizes = torch.tensor([s.elem_size for s in slots], dtype=torch.int64, device=device)
        slot_of_word = (torch.searchsorted(starts, words * 8, right=True) - 1).clamp_(min=0)
        words = words[sizes[slot_of_word] == elem_size]
    per_word = 8 // elem_size
    lanes = torch.arange(per_word, dtype=torch.int64, device=device)
    candidates = (words.unsqueeze(1) * per_word + lanes).flatten()
    old_elems, new_elems = typed(previous, elem_size), typed(new, elem_size)
    differ = torch.ne(old_elems.index_select(0, candidates), new_elems.index_select(0, candidates))
    changed = candidates[differ]  # ascending element numbers in the range
    # each member's changed elements are one run of ``changed``: [first, last)
    first_elem = torch.tensor([slots[i].offset // elem_size for i in members], device=device)
    last_elem = first_elem + torch.tensor(
        [slots[i].num_bytes // elem_size for i in members], device=device
    )
    bounds = torch.stack(
        [torch.searchsorted(changed, first_elem), torch.searchsorted(changed, last_elem)]
    ).tolist()
    counts = [hi - lo for lo, hi in zip(*bounds, strict=True)]
    # runs between members (padding, other slots' words) are dropped: element k of the
    # kept ones is ``changed[k + shift]``, ``shift`` being its run's start less the kept
    # elements before that run
    total, shifts = 0, []
    for lo, count in zip(bounds[0], counts, strict=True):
        shifts.append(lo - total)
        total += count
    repeats = torch.tensor(counts, device=device)
    keep = torch.arange(total, device=device) + torch.repeat_interleave(
        torch.tensor(shifts, device=device), repeats, output_size=total
    )
    changed = changed.index_select(0, keep)
    slot_first = torch.repeat_interleave(first_elem, repeats, output_size=total)
    indices = (changed - slot_first).to(torch.int32)
    values = new_elems.index_select(0, changed)
    return indices, values, counts


def _entry(
    slot: FlushSlot, indices: torch.Tensor, values: torch.Tensor, max_fraction: float
) -> DeltaEntry | None:
    """As ``wire.encode`` decides for one slot."""
    if slot.num_bytes % slot.elem_size:
        return None
    num_elements = slot.num_bytes // slot.elem_size
    count = int(indices.numel())
    if num_elements > MAX_ELEMENTS:
        return None
    if entry_bytes(count, slot.elem_size) >= slot.num_bytes or count > max_fraction * num_elements:
        return None
    return DeltaEntry(slot.param_index, slot.elem_size, slot.num_bytes, indices, values)
