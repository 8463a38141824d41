"""Sender side: the previous update's bytes, and which engine ranks hold them.

A delta is the difference between the bytes staged now and those staged by the last
update, so the sender keeps a copy of every slot it staged, once per replica layout
(engine ranks sharing a layout receive the same bytes): as much memory as the bytes it
loads per update (``num_bytes``), in host memory or on the staging device.

Deltas are only sent to an engine rank that holds the stored bytes: one that received
the whole previous update. Everything is forgotten when an update failed (the next one
is written in full); an engine rank alone is forgotten when its publication changed
(a restart, a reconnect) or its writes failed, and gets full writes next time.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable

import torch

from p2pweights.delta.wire import DeltaEntry, encode

__all__ = ["PreviousBytes", "TargetKey"]

TargetKey = Hashable
"""An engine rank's runner, as the caller names it: (engine URL, engine rank, role)."""


class PreviousBytes:
    """The bytes of each (layout, parameter) the last update staged, and the engine
    ranks holding them."""

    def __init__(self, device: torch.device | None = None) -> None:
        """``device``: where copies live; None keeps each on the device it was staged on."""
        self._device = device
        self._slots: dict[tuple[Hashable, str], torch.Tensor] = {}
        self._holders: set[TargetKey] = set()
        self.sequence = 0
        """The update whose bytes are stored (0: none)."""

    @property
    def num_bytes(self) -> int:
        """Memory the stored bytes take."""
        return sum(t.numel() for t in self._slots.values())

    def next_sequence(self) -> int:
        """A number for the next update, above the stored one's and every earlier
        session's (nanoseconds since the epoch)."""
        return max(time.time_ns(), self.sequence + 1)

    def holds(self, target: TargetKey) -> bool:
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

    def finish(self, sequence: int, holders: Iterable[TargetKey]) -> None:
        """The update ``sequence`` succeeded: its bytes are stored, and ``holders``
        received all of them."""
        self.sequence = sequence
        self._holders = set(holders)

    def forget_target(self, target: TargetKey) -> None:
        """``target`` no longer holds the stored bytes (its next update is full)."""
        self._holders.discard(target)

    def forget(self) -> None:
        """An update failed: drop everything; the next update is written in full."""
        self._slots.clear()
        self._holders.clear()
        self.sequence = 0
