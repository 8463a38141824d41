"""Writes the executor stopped waiting for, kept with the staging buffer they read.

A write batch is late when the executor gave up waiting for its writer
(``timeouts.transfer``) or when the transport gave up on it while its transfers were
still in flight (``UnsettledWrite``). Either way it may still read its staging buffer
and land in its engine rank. It counts as settled once its writer returned and the
transport saw every transfer finish or fail; until then its buffer is not deregistered
or freed, and its engine rank not written again. The run that gave up on it may refill
the buffer for the other ranks (that rank failed: whatever stale bytes still land there
land in a torn rank, which a later update rewrites only once the write settled).
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, Future, wait
from dataclasses import dataclass

from p2pweights.errors import TransferError, UnsettledWrite, some_of
from p2pweights.transfer.buffers import StagingBuffer
from p2pweights.transfer.writers import TargetKey, WriteBatch


@dataclass(eq=False)
class LateWrite:
    """One write batch given up on, and the staging buffer it reads."""

    future: Future[None]
    batch: WriteBatch
    buffer: StagingBuffer

    def settle(self, timeout_s: float) -> bool:
        """Whether it settled, waiting up to ``timeout_s`` (checked at least once)."""
        deadline = time.monotonic() + timeout_s
        done, _ = wait([self.future], timeout=max(timeout_s, 0.0))
        if not done:
            return False
        try:
            error = self.future.exception()
        except CancelledError:
            return True  # never started
        if isinstance(error, UnsettledWrite):
            return error.settle(max(deadline - time.monotonic(), 0.0))
        return True


class LateWrites:
    """The late writes of one executor, until each settled."""

    def __init__(self) -> None:
        self._writes: list[LateWrite] = []

    def __bool__(self) -> bool:
        return bool(self._writes)

    def add(self, future: Future[None], batch: WriteBatch, buffer: StagingBuffer) -> None:
        self._writes.append(LateWrite(future, batch, buffer))

    def extend(self, other: LateWrites) -> None:
        self._writes.extend(other._writes)
        other._writes = []

    def settle(self, timeout_s: float, buffer: StagingBuffer | None = None) -> list[LateWrite]:
        """Settle those reading ``buffer`` (every one if None), all within ``timeout_s``;
        forget the settled ones and return those still in flight."""
        deadline = time.monotonic() + timeout_s
        kept = []
        for write in self._writes:
            chosen = buffer is None or write.buffer is buffer
            if not chosen or not write.settle(max(deadline - time.monotonic(), 0.0)):
                kept.append(write)
        self._writes = kept
        return [w for w in kept if buffer is None or w.buffer is buffer]

    def reading(self, buffer: StagingBuffer) -> bool:
        """Whether a write not seen settled reads ``buffer``."""
        return any(write.buffer is buffer for write in self._writes)

    @property
    def targets(self) -> frozenset[TargetKey]:
        """The engine ranks with a write not seen settled."""
        return frozenset(write.batch.key for write in self._writes)


def still_in_flight(writes: list[LateWrite], timeout_s: float, refused: str) -> TransferError:
    """The error for writes that did not settle: which engine ranks, and what to do."""
    return TransferError(
        f"{some_of([w.batch.describe() for w in writes])}: {len(writes)} write(s) given "
        f"up on are still in flight after timeouts.transfer={timeout_s:g} and may still "
        f"land, so those engine ranks stay torn and {refused} is refused (their staging "
        f"buffer is kept as it is). update() again once the engine is responsive, or close() "
        f"this session (the memory they read is then kept, never freed) and connect a new one"
    )
