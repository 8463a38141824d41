"""The data path of one update: stage parameter groups, stream them to engine ranks.

``UpdatePipeline.stage`` reserves one parameter group's bytes in the current
staging buffer and queues a write of each parameter to every engine rank that
needs those bytes. When the buffer is full it is flushed: the replicas load the
staged groups' bytes (sglang's own loaders, one call per replica), its batches
go to the engines' writer threads and filling continues in the other buffer,
which is reused only once every write reading it has returned. ``finish`` flushes
the rest and waits; any failed, refused or late write fails the update.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from p2pweights.engines.published import RankPublication
from p2pweights.errors import TransferError
from p2pweights.transfer.buffers import StagingBuffer, StagingBuffers, staged_bytes
from p2pweights.transfer.transports.base import Write
from p2pweights.transfer.writers import EngineWriter, WriteBatch

HfInput = tuple[str, torch.Tensor]
LoadFn = Callable[[Hashable, list[HfInput], dict[str, torch.Tensor]], None]
"""``load(replica_key, hf_inputs, views)`` fills the views (param name -> flat uint8 view)
with the bytes replica ``replica_key``'s loaders make of ``hf_inputs``."""


@dataclass
class PipelineStats:
    """What one update moved and where its time went."""

    bytes_by_target: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    load_s: float = 0.0
    wait_s: float = 0.0
    num_flushes: int = 0

    @property
    def bytes_written(self) -> int:
        return sum(self.bytes_by_target.values())


class UpdatePipeline:
    """Stages groups into two buffers and hands full buffers to per-engine writers.

    Groups are loaded in batches: everything one replica stages into a buffer is
    loaded by a single ``load`` call just before the buffer is flushed, so the
    loaders' per-call overhead is paid once per buffer, not once per group.
    """

    def __init__(
        self,
        buffers: StagingBuffers,
        writers: Mapping[str, EngineWriter],
        timeout_s: float,
        load: LoadFn,
    ):
        self._buffers = buffers
        self._writers = writers
        self._timeout_s = timeout_s
        self._load = load
        buffers.reset()
        self._staged: dict[Hashable, tuple[list[HfInput], dict[str, torch.Tensor]]] = {}
        self._batches: dict[tuple[str, int, str], WriteBatch] = {}
        self._pending: dict[int, list[tuple[Future[None], WriteBatch]]] = {0: [], 1: []}
        self.stats = PipelineStats()

    def stage(
        self,
        key: Hashable,
        sizes: Mapping[str, int],
        inputs: Sequence[HfInput],
        targets: Sequence[RankPublication],
    ) -> None:
        """Reserve one group of replica ``key`` (param name -> bytes) and queue it for every target.

        Its bytes are loaded from ``inputs`` once, at the next flush, whatever the
        number of targets.
        """
        total = staged_bytes(sizes.values())
        if total > self._buffers.capacity_bytes:
            raise TransferError(
                f"a parameter group of {total} bytes does not fit a {self._buffers.capacity_bytes}"
                f"-byte staging buffer (parameters {sorted(sizes)}); raise buffer_bytes"
            )
        buffer = self._buffers.current
        if buffer.capacity_bytes - buffer.used_bytes < total:
            buffer = self._flush()
        staged_inputs, staged_views = self._staged.setdefault(key, ([], {}))
        staged_inputs.extend(inputs)
        for name, num_bytes in sizes.items():
            offset = buffer.reserve(num_bytes)
            assert offset is not None  # the whole group was checked to fit
            staged_views[name] = buffer.view(offset, num_bytes)
            for target in targets:
                self._queue(target, name, buffer.address + offset, num_bytes)

    def _queue(self, target: RankPublication, param: str, src: int, num_bytes: int) -> None:
        """Queue one parameter's write, checked against the region the engine published."""
        region = target.regions.get(param)
        where = f"{target.where} parameter {param!r}"
        if region is None:
            raise TransferError(f"{where} was not published by the engine; refusing to write")
        if num_bytes != region.num_bytes:
            raise TransferError(
                f"{where}: {num_bytes} bytes staged but the engine published "
                f"{region.num_bytes}; refusing to write outside the published region"
            )
        key = (target.engine_url, target.engine_rank, target.role)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = WriteBatch(target)
        batch.add(Write(src, region.address, num_bytes), param)

    def _flush(self) -> StagingBuffer:
        """Load and send the current buffer; return the other buffer once its writes returned."""
        started = time.perf_counter()
        for key, (inputs, views) in self._staged.items():
            self._load(key, inputs, views)
        self._staged = {}
        if self._buffers.current.tensor.is_cuda:
            # Loaders copy asynchronously on the GPU; writers must read finished bytes.
            torch.cuda.current_stream(self._buffers.current.tensor.device).synchronize()
        self.stats.load_s += time.perf_counter() - started
        index = self._buffers.current_index
        for key, batch in self._batches.items():
            future = self._writers[batch.target.engine_url].submit(batch)
            self._pending[index].append((future, batch))
            self.stats.bytes_by_target[key[:2]] += batch.num_bytes  # target and draft together
        self._batches = {}
        self.stats.num_flushes += 1
        buffer = self._buffers.swap()
        self._wait(self._pending[1 - index])
        buffer.used_bytes = 0
        return buffer

    def finish(self) -> PipelineStats:
        """Flush what is staged and wait for every write; raise if any failed or is late."""
        if self._batches or self._staged:
            self._flush()
        for index in (0, 1):
            self._wait(self._pending[index])
        self._buffers.current.used_bytes = 0
        return self.stats

    def abort(self) -> list[Future[None]]:
        """After a failure: cancel queued writes; return those already running.

        Running writes cannot be cancelled (transports finish or time them out), so
        the caller must keep the staging buffers alive until they have returned.
        """
        running = []
        for pending in self._pending.values():
            for future, _ in pending:
                if not future.cancel() and not future.done():
                    running.append(future)
            pending.clear()
        return running

    def _wait(self, pending: list[tuple[Future[None], WriteBatch]]) -> None:
        if not pending:
            return
        started = time.perf_counter()
        _, not_done = wait([future for future, _ in pending], timeout=self._timeout_s)
        self.stats.wait_s += time.perf_counter() - started
        if not_done:
            late = [batch.describe() for future, batch in pending if future in not_done]
            raise TransferError(
                f"writes still running after transfer_timeout_s={self._timeout_s}: "
                + "; ".join(late)
            )
        for future, _ in pending:
            error = future.exception()
            if error is not None:
                raise error
        pending.clear()
