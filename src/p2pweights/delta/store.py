"""Sender side: the previous update's bytes, and which engine ranks hold them.

A delta is the difference between the bytes staged now and those staged by the last
update, so the sender keeps a copy of every slot it staged, once per replica layout
(engine ranks sharing a layout receive the same bytes): as much memory as the bytes it
loads per update (``num_bytes``), in host memory or on the staging device.

The copy is kept per staging flush (``compare_flush``): an image of the flushed range
of the buffer, compared in one pass (``flush_compare``) with the same range next time,
where the next update's flush at that position holds the same slots at the same
offsets (a trainer sending the same model the same way: every update after the
first). A flush laid out otherwise is compared slot by slot against the stored bytes
of each parameter wherever they were, and its image replaces the old one. A store in
host memory is copied to the device of the staging buffer to compare a flush there (one
flush's bytes more on that device while it compares).

Deltas are only sent to an engine rank that holds the stored bytes: one that received
the whole previous update. Everything is forgotten when an update failed (the next one
is written in full); an engine rank alone is forgotten when its publication changed
(a restart, a reconnect) or its writes failed, and gets full writes next time.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from p2pweights.delta.flush_compare import FlushSlot, encode_flush
from p2pweights.wire.delta import DeltaEntry, encode
from p2pweights.wire.publication import Runner

__all__ = ["FlushLayout", "PreviousBytes"]


@dataclass(frozen=True)
class FlushLayout:
    """Which parameter each slot of a flushed range holds: (layout key, parameter), the
    slot's offset from the range's start and its bytes, in the range's order."""

    slots: tuple[tuple[Hashable, str, int, int], ...]
    num_bytes: int
    """The range's bytes (whole 8-byte words; padding between slots included)."""


@dataclass
class _Image:
    layout: FlushLayout
    data: torch.Tensor


class PreviousBytes:
    """The bytes of each (layout, parameter) the last update staged, and the engine
    ranks holding them."""

    def __init__(self, device: torch.device | None = None) -> None:
        """``device``: where copies live; None keeps each on the device it was staged on."""
        self._device = device
        # Each parameter's stored bytes (views into ``_images`` where they came by flush).
        self._slots: dict[tuple[Hashable, str], torch.Tensor] = {}
        # Flush position in an update -> the image of that flush's range.
        self._images: dict[int, _Image] = {}
        # Parameters this update's flushes staged so far.
        self._seen: set[tuple[Hashable, str]] = set()
        self._holders: set[Runner] = set()
        # The update whose bytes are stored (0: none).
        self.sequence = 0

    @property
    def num_bytes(self) -> int:
        """Memory the stored bytes take: every storage they hold (an image's padding between
        slots included, and an older image a parameter's bytes are still in)."""
        storages = {}
        for tensor in [*self._slots.values(), *(image.data for image in self._images.values())]:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def next_sequence(self) -> int:
        """A number for the next update, above the stored one's and every earlier
        session's (nanoseconds since the epoch)."""
        return max(time.time_ns(), self.sequence + 1)

    def holds(self, target: Runner) -> bool:
        """Whether ``target`` holds the stored bytes (a delta against them fits it)."""
        return self.sequence != 0 and target in self._holders

    def delta(
        self,
        key: Hashable,
        param: str,
        new: torch.Tensor,
        elem_size: int,
        *,
        param_index: int = 0,
        max_fraction: float = 1.0,
    ) -> DeltaEntry | None:
        """The entry from the stored bytes of ``param`` to ``new`` (a flat uint8 view), or
        None (nothing stored for it, or a full write is no larger)."""
        previous = self._slots.get((key, param))
        if previous is None or previous.numel() != new.numel():
            return None
        if previous.device != new.device:
            previous = previous.to(new.device)
        return encode(previous, new, elem_size, param_index=param_index, max_fraction=max_fraction)

    def remember(self, key: Hashable, param: str, new: torch.Tensor) -> None:
        """Store ``new`` as the bytes of ``param`` (copied; storage reused when it fits)."""
        stored = self._slots.get((key, param))
        device = self._device or new.device
        if stored is None or stored.numel() != new.numel() or stored.device != device:
            stored = self._slots[(key, param)] = torch.empty_like(new, device=device)
        stored.copy_(new)

    def compare_flush(
        self,
        position: int,
        layout: FlushLayout,
        new: torch.Tensor,
        compare: Sequence[FlushSlot | None],
        *,
        max_fraction: float = 1.0,
    ) -> list[DeltaEntry | None]:
        """The entries of a flushed range (``new``: flat uint8, ``layout.num_bytes``) against
        the stored bytes, and ``new`` stored in their place. ``compare`` holds, per slot of
        ``layout``, how to compare it, or None where no entry is wanted (a full write);
        ``position`` is the flush's number in its update."""
        self._seen.update((key, param) for key, param, _, _ in layout.slots)
        image = self._images.get(position)
        if (
            image is not None
            and image.layout == layout
            and image.data.device == (self._device or new.device)
        ):
            previous = image.data if image.data.device == new.device else image.data.to(new.device)
            wanted = [(i, s) for i, s in enumerate(compare) if s is not None]
            found = (
                encode_flush(previous, new, [s for _, s in wanted], max_fraction=max_fraction)
                if wanted
                else []
            )
            entries: list[DeltaEntry | None] = [None] * len(compare)
            for (i, _), entry in zip(wanted, found, strict=True):
                entries[i] = entry
            image.data.copy_(new)  # its slots' views in ``_slots`` now hold the new bytes
            return entries
        entries = []
        for (key, param, offset, num_bytes), how in zip(layout.slots, compare, strict=True):
            entry = None
            if how is not None:
                entry = self.delta(
                    key,
                    param,
                    new[offset : offset + num_bytes],
                    how.elem_size,
                    param_index=how.param_index,
                    max_fraction=max_fraction,
                )
            entries.append(entry)
        data = torch.empty_like(new, device=self._device or new.device)
        data.copy_(new)
        self._images[position] = _Image(layout, data)
        for key, param, offset, num_bytes in layout.slots:
            self._slots[(key, param)] = data[offset : offset + num_bytes]
        return entries

    def finish(
        self, sequence: int, holders: Iterable[Runner], num_flushes: int | None = None
    ) -> None:
        """The update ``sequence`` succeeded: its bytes are stored, and ``holders``
        received all of them; images of flush positions past its ``num_flushes`` go."""
        if num_flushes is not None:
            for position in [p for p in self._images if p >= num_flushes]:
                del self._images[position]
            if self._seen:  # bytes of parameters this update did not stage: not kept
                for key in [k for k in self._slots if k not in self._seen]:
                    del self._slots[key]
        self._seen.clear()
        self.sequence = sequence
        self._holders = set(holders)

    def stale(self) -> None:
        """An update was sent in full without storing its bytes: no engine rank holds the
        stored ones (the next update is full). Their memory is kept: the next update that
        stores its bytes copies them there."""
        self._seen.clear()
        self._holders.clear()
        self.sequence = 0

    def forget_target(self, target: Runner) -> None:
        """``target`` no longer holds the stored bytes (its next update is full)."""
        self._holders.discard(target)

    def forget(self) -> None:
        """An update failed: drop everything; the next update is written in full."""
        self._slots.clear()
        self._images.clear()
        self._seen.clear()
        self._holders.clear()
        self.sequence = 0
