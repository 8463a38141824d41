"""Executing a byte plan: two staging buffers, one writer per engine rank, writes in flight.

``TransferExecutor`` lives as long as a session. It owns the staging buffers
(allocated and registered with the transport once, at connect), a ``RankWriter``
per engine rank, and the writes of a failed update that may still be running.

``run`` stages each group as its inputs complete: the group's block is reserved in
the current buffer and its planned writes are queued for every engine rank that
needs it. When the buffer is full it is flushed: the replicas load the staged
groups' bytes (sglang's own loaders, one call per replica and buffer), the batches
go to the writers, and filling continues in the other buffer, reused only once
every write reading it has returned. A failed or late write fails its engine rank,
not the others: later batches to it are skipped while the other ranks get all
their bytes, and ``RunResult`` says which engines received everything.

Where the transport maps an engine rank's memory for plain device copies
(``Transport.direct_view``: CUDA IPC into the trainer's own GPU, colocated), that
rank's groups skip staging: the replicas load straight into its memory, at each flush
with the staged groups, at most a buffer's worth at a time.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from p2pweights.engines.published import RankPublication
from p2pweights.errors import TransferError
from p2pweights.plan.byte_plan import BytePlan, GroupPlan, TargetWrites
from p2pweights.transfer.buffers import StagingBuffer, StagingBuffers
from p2pweights.transfer.transports.base import Transport, Write
from p2pweights.transfer.writers import FailedTargets, RankWriter, TargetKey, WriteBatch

logger = logging.getLogger(__name__)

__all__ = ["HfInput", "LoadFn", "ReadyGroup", "RunResult", "TransferExecutor"]

HfInput = tuple[str, torch.Tensor]
LoadFn = Callable[[Hashable, list[HfInput], dict[str, torch.Tensor]], None]
"""``load(replica_key, hf_inputs, views)`` fills the views (param name -> flat uint8 view)
with the bytes replica ``replica_key``'s loaders make of ``hf_inputs``."""
ReadyGroup = tuple[GroupPlan, Sequence[HfInput]]
"""A planned group whose inputs all arrived, with those inputs."""

_MAX_FAILURES_NAMED = 4


@dataclass
class RunResult:
    """What one update moved, where its time went, and which engine ranks failed."""

    bytes_by_target: dict[TargetKey, int] = field(default_factory=lambda: defaultdict(int))
    load_s: float = 0.0
    wait_s: float = 0.0
    num_flushes: int = 0
    failures: dict[TargetKey, BaseException] = field(default_factory=dict)

    @property
    def bytes_written(self) -> int:
        return sum(self.bytes_by_target.values())

    def complete(self, engine_url: str) -> bool:
        """Whether every write this trainer rank made into ``engine_url`` landed."""
        return all(url != engine_url for url, _ in self.failures)

    def raise_if_failed(self) -> None:
        if not self.failures:
            return
        errors = list(self.failures.values())
        named = "; ".join(str(e) for e in errors[:_MAX_FAILURES_NAMED])
        more = len(errors) - _MAX_FAILURES_NAMED
        raise TransferError(
            f"{len(errors)} engine rank(s) did not receive all their bytes: {named}"
            + (f" (and {more} more)" if more > 0 else "")
        ) from errors[0]


class TransferExecutor:
    """Staging buffers, writers and in-flight writes of one session."""

    def __init__(self, transport: Transport, staging_device: torch.device, timeout_s: float):
        self._transport = transport
        self._device = staging_device
        self._timeout_s = timeout_s
        self._buffers: StagingBuffers | None = None
        self._writers: dict[TargetKey, RankWriter] = {}
        self._connected: dict[tuple[str, int, str], RankPublication] = {}
        self._unfinished: list[Future[None]] = []

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffers is None else self._buffers.capacity_bytes

    def reserve(self, num_bytes: int) -> None:
        """Staging buffers of at least ``num_bytes`` each, registered with the transport.

        Called at connect with the best size known then; a larger plan grows them
        (a new pair, registered again; the old pair is released).
        """
        if self._buffers is not None and self._buffers.capacity_bytes >= num_bytes:
            return
        self.settle()
        if self._buffers is not None:
            logger.info(
                "staging buffers grow from %d to %d bytes (a parameter group needs it)",
                self._buffers.capacity_bytes,
                num_bytes,
            )
            self._release_buffers()
        self._buffers = StagingBuffers(
            num_bytes, self._device, self._transport.register, self._transport.unregister
        )

    def _release_buffers(self) -> None:
        """Deregister the buffers before their memory goes back to the allocator."""
        if self._buffers is not None:
            for buffer in self._buffers.buffers:
                self._transport.unregister(buffer.tensor)
            self._buffers = None

    @property
    def connected(self) -> Mapping[tuple[str, int, str], RankPublication]:
        """(engine URL, engine rank, role) -> the publication it is connected by."""
        return dict(self._connected)

    @property
    def writer_keys(self) -> frozenset[TargetKey]:
        """The engine ranks that have a writer."""
        return frozenset(self._writers)

    def connect(self, targets: Iterable[RankPublication]) -> None:
        """Make exactly these engine ranks writable: a transport connection and a writer each.

        What was connected before and is not among ``targets`` (an engine removed, or
        restarted on new addresses) loses its writer and its transport connection, so
        nothing is ever written to a registration that went stale; the staging buffers
        stay registered.
        """
        wanted = {(pub.engine_url, pub.engine_rank, pub.role): pub for pub in targets}
        stale = {key: pub for key, pub in self._connected.items() if wanted.get(key) != pub}
        keep = {(url, rank) for url, rank, _ in wanted} - {(url, rank) for url, rank, _ in stale}
        for gone in [k for k in self._writers if k not in keep]:
            self._writers.pop(gone).close()  # waits for a running write; queued ones cancelled
        self._forget(stale)
        for key, pub in wanted.items():
            self._transport.connect(pub)
            self._connected[key] = pub
            writer_key = (pub.engine_url, pub.engine_rank)
            if writer_key not in self._writers:
                self._writers[writer_key] = RankWriter(writer_key, self._transport, self._timeout_s)

    def disconnect(self) -> None:
        """Stop every writer and drop every transport connection (buffers stay registered)."""
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
        self._forget(dict(self._connected))

    def _forget(self, stale: Mapping[tuple[str, int, str], RankPublication]) -> None:
        """Drop these connections; a transport peer goes once no kept publication uses it."""
        for key in stale:
            del self._connected[key]
        kept = {_peer(pub) for pub in self._connected.values()}
        for pub in {_peer(pub): pub for pub in stale.values()}.values():
            if _peer(pub) not in kept:
                self._transport.disconnect(pub)

    def run(self, plan: BytePlan, ready: Iterable[ReadyGroup], load: LoadFn) -> RunResult:
        """Stage and write every group ``ready`` yields; returns once all writes returned.

        A write that fails or is late fails its engine rank (``RunResult.failures``);
        any other exception (bad input, a loader error, an interrupt) stops the run,
        and writes still running are kept for ``settle``.
        """
        self.settle()
        if self._buffers is None or self._buffers.capacity_bytes < plan.buffer_bytes:
            raise TransferError(
                f"staging buffers of {self.buffer_bytes} bytes cannot hold the plan's largest "
                f"group ({plan.buffer_bytes} bytes); reserve() them first"
            )
        update = _Run(self._buffers, self._writers, self._timeout_s, load, self._transport)
        try:
            for group, inputs in ready:
                update.stage(group, inputs)
            result = update.finish()
        except BaseException:
            self._unfinished = update.abort() + update.late
            raise
        self._unfinished = update.late  # late writes still read the buffers
        return result

    def settle(self) -> None:
        """Before the buffers are reused or released, let a failed update's writes return."""
        if not self._unfinished:
            return
        _, running = wait(self._unfinished, timeout=self._timeout_s)
        if running:
            raise TransferError(
                f"{len(running)} write(s) of the last, failed update are still running after "
                f"transfer_timeout_s={self._timeout_s}; an engine is stuck. close() this "
                f"session and connect a new one"
            )
        self._unfinished = []

    def close(self) -> None:
        """Stop the writers (a running write returns within its timeout) and drop the buffers."""
        self.disconnect()
        self._unfinished = []
        self._release_buffers()


@contextlib.contextmanager
def _one_intra_op_thread(on_host: bool) -> Iterator[None]:
    """Host-side loads run on one torch intra-op thread, then the old count is restored.

    The loaders' work is mostly large ``copy_``s, which torch splits over its intra-op
    threads and joins at a barrier; when the writer thread or another process holds a
    core, every copy waits for it. Measured on the 2-core machine (benchmarks/cpu_cost.py,
    1 GB into a TP-2 engine): the load stage took 1-4 s with two threads while using
    0.2-0.4 CPU-s, and 0.055-0.07 s with one. The setting is process-wide while loads run.
    """
    if not on_host:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _DirectLoad:
    """Groups of one replica an engine rank receives straight into its memory."""

    target: RankPublication
    inputs: list[HfInput] = field(default_factory=list)
    views: dict[str, torch.Tensor] = field(default_factory=dict)


def _peer(pub: RankPublication) -> tuple[str, str | None, str | None]:
    """Who a publication is reached through (a target and its draft may share it)."""
    return (pub.backend, pub.session_id, pub.agent_name)


class _Run:
    """One update's staging state: what is staged in the current buffer, batches, futures."""

    def __init__(
        self,
        buffers: StagingBuffers,
        writers: dict[TargetKey, RankWriter],
        timeout_s: float,
        load: LoadFn,
        transport: Transport,
    ):
        self._buffers = buffers
        self._writers = writers
        self._timeout_s = timeout_s
        self._load = load
        self._transport = transport
        buffers.reset()
        self._staged: dict[Hashable, tuple[list[HfInput], dict[str, torch.Tensor]]] = {}
        # loads straight into engine memory, per (replica, engine rank and runner)
        self._direct: dict[tuple[Hashable, tuple[str, int, str]], _DirectLoad] = {}
        self._direct_bytes: dict[tuple[str, int, str], int] = defaultdict(int)
        self._direct_devices: set[torch.device] = set()
        """GPUs direct loads queued copies on: synchronized before the run returns or fails."""
        # one batch per publication: a rank's draft is reached through its own handle
        self._batches: dict[tuple[str, int, str], WriteBatch] = {}
        self._pending: dict[int, list[tuple[Future[None], WriteBatch]]] = {0: [], 1: []}
        self._failed = FailedTargets()
        self.result = RunResult()
        self.late: list[Future[None]] = []
        """Writes given up on after the timeout that have not returned yet."""

    def stage(self, group: GroupPlan, inputs: Sequence[HfInput]) -> None:
        self._stop_if_every_rank_failed()
        staged = []
        for tw in group.targets:
            key = (tw.target.engine_url, tw.target.engine_rank, tw.target.role)
            if self._failed.get(key[:2]) is not None:
                continue  # this rank already failed; the others carry on
            try:
                views = self._direct_views(group, tw)
            except TransferError as exc:  # refused for this rank alone, as a failed write
                self._failed.record(key[:2], exc)
                continue
            if views is None:
                staged.append(tw)
                continue
            if self._direct_bytes[key] + group.block_bytes > self._buffers.current.capacity_bytes:
                self._flush()  # bounds a load's size (and its replay check's scratch)
            direct = self._direct.setdefault((group.key, key), _DirectLoad(tw.target))
            direct.inputs.extend(inputs)
            direct.views.update(views)
            self._direct_bytes[key] += group.block_bytes
        if staged:
            self._stage(group, inputs, staged)

    def _stop_if_every_rank_failed(self) -> None:
        """Every engine rank this trainer rank writes has failed: fail the update now
        instead of reading the rest of the input for nothing (a streamed update may take
        seconds to end). While some rank is healthy, it still gets every byte."""
        failed = self._failed.errors()
        if not failed or not set(self._writers) <= failed.keys():
            return
        errors = list(failed.values())
        named = "; ".join(str(e) for e in errors[:_MAX_FAILURES_NAMED])
        raise TransferError(
            f"every engine rank this trainer rank writes failed ({len(errors)}), so the update "
            f"stopped before its input ended: {named}"
        ) from errors[0]

    def _direct_views(self, group: GroupPlan, tw: TargetWrites) -> dict[str, torch.Tensor] | None:
        """The engine rank's memory for every slot of ``group``, if the transport maps it
        for plain copies (a load writes every slot of its group: all or none)."""
        if {w.slot for w in tw.writes} != set(range(len(group.slots))):
            return None
        views = {}
        for w in tw.writes:
            slot = group.slots[w.slot]
            view = self._transport.direct_view(tw.target, w.dst_address, slot.num_bytes)
            if view is None:
                return None
            views[slot.param] = view
        return views

    def _stage(
        self, group: GroupPlan, inputs: Sequence[HfInput], targets: Sequence[TargetWrites]
    ) -> None:
        buffer = self._buffers.current
        if buffer.capacity_bytes - buffer.used_bytes < group.block_bytes:
            buffer = self._flush()
        base = buffer.reserve(group.block_bytes)
        assert base is not None  # the plan sized the buffers for its largest block
        staged_inputs, views = self._staged.setdefault(group.key, ([], {}))
        staged_inputs.extend(inputs)
        start = buffer.address + base
        for slot in group.slots:
            views[slot.param] = buffer.view(base + slot.offset, slot.num_bytes)
        for tw in targets:
            key = (tw.target.engine_url, tw.target.engine_rank, tw.target.role)
            batch = self._batches.get(key)
            if batch is None:
                batch = self._batches[key] = WriteBatch(tw.target)
            for w in tw.writes:
                slot = group.slots[w.slot]
                batch.add(
                    Write(start + slot.offset, w.dst_address, slot.num_bytes, w.dst_device),
                    slot.param,
                )

    def _flush(self) -> StagingBuffer:
        """Load and send the current buffer; return the other one once its writes returned."""
        started = time.perf_counter()
        with _one_intra_op_thread(not self._buffers.current.tensor.is_cuda):
            for key, (inputs, views) in self._staged.items():
                self._load(key, inputs, views)
        self._staged = {}
        if self._buffers.current.tensor.is_cuda:
            # Loaders copy asynchronously on the GPU; writers must read finished bytes.
            torch.cuda.current_stream(self._buffers.current.tensor.device).synchronize()
        self.result.load_s += time.perf_counter() - started
        index = self._buffers.current_index
        for batch in self._batches.values():
            if self._failed.get(batch.key) is not None:
                continue  # this rank already failed; the others carry on
            future = self._writers[batch.key].submit(batch, self._failed)
            self._pending[index].append((future, batch))
            self.result.bytes_by_target[batch.key] += batch.num_bytes
        self._batches = {}
        self._load_direct()  # while the writers send the staged bytes
        self.result.num_flushes += 1
        buffer = self._buffers.swap()
        self._wait(self._pending[1 - index])
        buffer.used_bytes = 0
        return buffer

    def _load_direct(self) -> None:
        """Load the direct groups into the engines' memory, and wait for the copies: an
        engine reads its memory once ``end_weight_update`` returns."""
        started = time.perf_counter()
        for (key, target), direct in self._direct.items():
            if self._failed.get(target[:2]) is not None:
                continue
            self._direct_devices.update(v.device for v in direct.views.values() if v.is_cuda)
            self._load(key, direct.inputs, direct.views)
            num_bytes = sum(v.numel() for v in direct.views.values())
            self.result.bytes_by_target[target[:2]] += num_bytes
        self._direct = {}
        self._direct_bytes.clear()
        self._sync_direct()
        self.result.load_s += time.perf_counter() - started

    def _sync_direct(self) -> None:
        for device in self._direct_devices:
            torch.cuda.current_stream(device).synchronize()
        self._direct_devices.clear()

    def finish(self) -> RunResult:
        if self._batches or self._staged or self._direct:
            self._flush()
        for index in (0, 1):
            self._wait(self._pending[index])
        self._buffers.current.used_bytes = 0
        self.result.failures = self._failed.errors()
        return self.result

    def abort(self) -> list[Future[None]]:
        """Cancel queued writes; return those already running (they still read the buffers).
        Copies a direct load queued are waited for: the engine's memory may be closed next."""
        with contextlib.suppress(Exception):  # the run failed already; report that error
            self._sync_direct()
        running = []
        for pending in self._pending.values():
            for future, _ in pending:
                if not future.cancel() and not future.done():
                    running.append(future)
            pending.clear()
        return running

    def _wait(self, pending: list[tuple[Future[None], WriteBatch]]) -> None:
        """Wait for one buffer's writes; failures are recorded per engine rank, not raised."""
        if not pending:
            return
        started = time.perf_counter()
        _, not_done = wait([future for future, _ in pending], timeout=self._timeout_s)
        self.result.wait_s += time.perf_counter() - started
        for future, batch in pending:
            if future in not_done:
                self.late.append(future)
                self._failed.record(
                    batch.key,
                    TransferError(
                        f"write to {batch.describe()} still running after "
                        f"transfer_timeout_s={self._timeout_s}"
                    ),
                )
            elif future.exception() is not None:
                self._failed.record(batch.key, future.exception())  # type: ignore[arg-type]
        pending.clear()
