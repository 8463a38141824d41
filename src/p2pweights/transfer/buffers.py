"""Two staging buffers: one is filled while the writes reading the other are in flight.

A buffer lives where the transport reads fastest: pinned host memory (page-locked
when a CUDA device exists; plain host memory on CPU-only hosts, where torch cannot
pin) or device memory. Both are allocated and registered with the transport once
and reused for every update; a buffer is refilled only after every write reading
it has returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from p2pweights.plan.byte_plan import ALIGNMENT_BYTES, aligned

__all__ = ["ALIGNMENT_BYTES", "aligned", "staged_bytes", "StagingBuffer", "StagingBuffers"]


def staged_bytes(sizes: Iterable[int]) -> int:
    """Buffer bytes a group of parameters of these sizes takes, alignment included."""
    return sum(aligned(n) for n in sizes)


def allocate_staging(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 buffer on ``device``; page-locked host memory when CUDA exists."""
    if device.type == "cpu":
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


class StagingBuffer:
    """One flat byte buffer, bump-allocated per flush, with the writes that read it."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.used_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return self.tensor.numel()

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    def reserve(self, num_bytes: int) -> int | None:
        """Offset of ``num_bytes`` fresh bytes, or None if they do not fit any more."""
        offset = self.used_bytes
        if offset + num_bytes > self.capacity_bytes:
            return None
        self.used_bytes = offset + aligned(num_bytes)
        return offset

    def view(self, offset: int, num_bytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + num_bytes]


class StagingBuffers:
    """The pair of staging buffers of one session, registered once."""

    def __init__(
        self,
        num_bytes: int,
        device: torch.device,
        register: Callable[[torch.Tensor], None],
        unregister: Callable[[torch.Tensor], None],
    ):
        """Both buffers registered, or (if registering one fails) neither."""
        self.buffers = [StagingBuffer(allocate_staging(num_bytes, device)) for _ in range(2)]
        registered: list[torch.Tensor] = []
        try:
            for buffer in self.buffers:
                register(buffer.tensor)
                registered.append(buffer.tensor)
        except BaseException:
            for tensor in registered:
                unregister(tensor)
            raise
        self._current = 0

    @property
    def capacity_bytes(self) -> int:
        return self.buffers[0].capacity_bytes

    @property
    def current(self) -> StagingBuffer:
        return self.buffers[self._current]

    @property
    def current_index(self) -> int:
        return self._current

    def reset(self) -> None:
        """Forget what was staged (the caller made sure no write still reads it)."""
        for buffer in self.buffers:
            buffer.used_bytes = 0

    def swap(self) -> StagingBuffer:
        """Make the other buffer current and return it (its old writes are not yet waited for)."""
        self._current = 1 - self._current
        return self.current
