"""Executing a byte plan: two staging buffers, one writer per engine rank, writes in flight.

``TransferExecutor`` lives as long as a session. It owns the staging buffers
(allocated and registered with the transport once, at connect), a ``RankWriter``
per engine rank, and the writes of a failed update that may still be running.

``run`` stages each group as its inputs complete: the group's block is reserved in
the current buffer for every engine rank that needs it. When the buffer is full it
is flushed: the loaders (the replicas: sglang's own loaders, one call per replica and
buffer) fill the staged groups' bytes, the writes are built from the plan and go to
the writers, and filling continues in the other buffer, reused once every write reading
it has returned or was given up on. A failed or late write fails its engine rank, not
the others: later batches to it are skipped while the other ranks get all their bytes
(a stuck rank holds no buffer: ``_Run._flush``), and ``RunResult`` says which engines
received everything.

Nothing reaches an engine before ``RunHooks.before_writes`` returned: the run calls it
once, after the first buffer was loaded and before its first write (or load into
engine memory), so a caller can open the engines' update sessions only then, with
the inputs read, checked, converted and the first buffer staged. It may return a new
plan (an engine published its weights afresh).

Each flush runs in phases, each against the plan it is given (``_Run._flush``):

1. stage or load: groups are reserved in the buffer (slot offsets: no address of any
   plan) or queued for a direct load (with the views of the plan current then); the
   loaders fill the staged bytes; deltas are compared. No engine is touched.
2. open: the first flush calls ``before_writes``; the plan it returns (or the current
   one) is the plan of every later phase of this flush and of the run. Where that opens
   (pauses) the engines, this buffer's write digests and weight-checker hashes are taken
   just before it, outside the pause; every later buffer's while its writes run.
3. place: delta entries are packed.
4. write: each runner's batch goes to its rank's writer, to the addresses of the
   phase-2 plan; direct loads go into the memory the same plan maps (views taken from
   an earlier plan are taken again), so a moved plan is never half applied.
5. settle: the other buffer comes back once its writes returned or were given up on.

Where the transport maps an engine rank's memory for plain device copies
(``Transport.direct_view``: CUDA IPC into the trainer's own GPU, colocated), that
rank's groups skip staging: the replicas load straight into its memory, at each flush
with the staged groups, at most a buffer's worth at a time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from p2pweights.config import DeltaConfig
from p2pweights.delta.sender import DeltaRun, DeltaSender, DeltaSummary, FullHeaders
from p2pweights.errors import TransferError, UnsettledWrite, some_of
from p2pweights.plan.byte_plan import BytePlan, GroupPlan, TargetWrites
from p2pweights.transfer.buffers import StagingBuffer, StagingBuffers
from p2pweights.transfer.intra_op import one_intra_op_thread
from p2pweights.transfer.late_writes import LateWrites, still_in_flight
from p2pweights.transfer.writers import (
    FailedTargets,
    RankWriter,
    TargetKey,
    WriteBatch,
    closed_writer,
)
from p2pweights.transports.base import Transport, Write, quarantine
from p2pweights.verification.checksums import StagedChecksums
from p2pweights.verification.staged import StagedDigests
from p2pweights.wire.delta import HEADER_BYTES, SCRATCH_NAME, pack_header
from p2pweights.wire.landed import LANDED_NAME, flag_names
from p2pweights.wire.publication import RankPublication, Runner

logger = logging.getLogger(__name__)

__all__ = ["HfInput", "Loader", "ReadyGroup", "RunHooks", "RunResult", "TransferExecutor"]

HfInput = tuple[str, torch.Tensor]
ReadyGroup = tuple[GroupPlan, Sequence[HfInput]]
"""A planned group whose inputs all arrived, with those inputs."""


class Loader(Protocol):
    """What makes one shard layout's bytes (a replica: ``GroupPlan.key`` names it)."""

    def load_into(self, inputs: Sequence[HfInput], views: Mapping[str, torch.Tensor]) -> None:
        """Fill ``views`` (parameter name -> flat uint8 view) with the bytes ``inputs`` make."""


@dataclass
class RunHooks:
    """What a run tells its caller, and when it asks it."""

    progress: Callable[[int], None] | None = None
    """Called with the bytes of each group staged (its block times its engine ranks)."""
    before_writes: Callable[[], BytePlan | None] | None = None
    """Called once per run before anything reaches an engine (also for a run that
    writes nothing); a plan it returns replaces the run's plan for every later write."""
    cancel: threading.Event | None = None
    """Once set, the run raises ``TransferError`` at its next group or flush."""
    digest_staged: bool = False
    """Digest every staged slot (``RunResult.digests``) for the engines' write check."""
    paused_before: bool = False
    """The engines were paused before the run began (``stage_before_pause`` off): all of
    its delta compare counts as paused (``RunResult.delta_paused_s``)."""
    flag_landed: frozenset[str] = frozenset()
    """Engine URLs whose ranks are told, after each flush's writes into them landed,
    which parameters did (``wire.landed``; ``SyncConfig.digest_as_written``)."""
    checksums: StagedChecksums | None = None
    """Hash every staged slot going to an engine checked through sglang's
    ``/weights_checker`` with sglang's own hash (``RunResult.checksums``)."""


@dataclass
class RunResult:
    """What one update moved, where its time went, and which engine ranks failed."""

    bytes_by_target: dict[TargetKey, int] = field(default_factory=lambda: defaultdict(int))
    load_s: float = 0.0
    wait_s: float = 0.0
    num_flushes: int = 0
    failures: dict[TargetKey, BaseException] = field(default_factory=dict)
    staged_digests: StagedDigests | None = field(default=None, repr=False)
    """With ``RunHooks.digest_staged``: the sums taken, not yet hashed (``digests``)."""
    _digests: dict[Runner, dict[str, str]] = field(default_factory=dict, repr=False)
    _partial: dict[Runner, dict[str, tuple[list[int], int]]] = field(
        default_factory=dict, repr=False
    )
    digest_s: float = 0.0
    checksums: dict[Runner, dict[str, str]] = field(default_factory=dict, repr=False)
    """With ``RunHooks.checksums``: runner -> parameter -> sglang's weight-checker hash of
    the bytes staged for it (or a direct load left in its memory)."""
    checksum_s: float = 0.0
    delta_s: float = 0.0
    """With ``SyncConfig.delta``: comparing staged slots with the previous update's."""
    delta_paused_s: float = 0.0
    """Of ``delta_s``, the seconds compared while the engines stood paused (every staging
    buffer after the first, or all with ``RunHooks.paused_before``)."""
    delta: DeltaSummary | None = None
    """With ``SyncConfig.delta``: the bytes a full update would have written, those
    written instead, the memory the previous update's copy takes, and whether the update
    went as a delta or in full and why (``DeltaSummary.decision``, ``DeltaConfig.mode``)."""

    @property
    def digests(self) -> dict[Runner, dict[str, str]]:
        """With ``RunHooks.digest_staged``: runner -> parameter -> digest of the bytes staged
        for it, or, for a direct load, of the bytes its loaders left at the addresses this
        rank mapped (so the engine's own digest of the parameter checks the mapping).

        Hashed on first use (on a GPU it waits for the sums there), from one thread: an
        update asks on a thread of its own while the engines end their sessions, so the
        host work overlaps their end (its seconds, in ``digest_s``, overlap theirs)."""
        pending, self.staged_digests = self.staged_digests, None  # hashed once, or failed
        if pending is not None:
            started = time.perf_counter()
            pending.into(self._digests)
            self._partial = pending.shares
            self.digest_s += time.perf_counter() - started
        return self._digests

    @property
    def partial_digests(self) -> dict[Runner, dict[str, tuple[list[int], int]]]:
        """Owner sends: runner -> parameter -> (lane sums, length) of this rank's share of
        a parameter other owners write too (``digests`` first); summed with theirs, they
        give the parameter's digest."""
        self.digests  # noqa: B018 (hashed, and the shares taken out, once)
        return self._partial

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
        raise TransferError(
            f"{len(errors)} engine rank(s) did not receive all their bytes: {some_of(errors)}"
        ) from errors[0]


class TransferExecutor:
    """Staging buffers, writers and in-flight writes of one session."""

    def __init__(
        self,
        transport: Transport,
        staging_device: torch.device,
        timeout_s: float,
        delta: DeltaConfig | None = None,
    ):
        self._transport = transport
        self._device = staging_device
        self._timeout_s = timeout_s
        self._buffers: StagingBuffers | None = None
        self._writers: dict[TargetKey, RankWriter] = {}
        self._connected: dict[Runner, RankPublication] = {}
        # Writes of failed updates not seen settled: their buffers are not handed out again.
        self._late = LateWrites()
        # Delta updates: the previous update's bytes and the engine ranks holding them.
        self._delta = DeltaSender(delta) if delta is not None else None
        # Bytes of 1, registered: what landed flags are written from (``wire.landed``).
        self._flag_source: torch.Tensor | None = None

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffers is None else self._buffers.capacity_bytes

    def reserve(self, num_bytes: int) -> None:
        """Staging buffers of at least ``num_bytes`` each, registered with the transport.

        Called at connect with the best size known then; a larger plan grows them
        (a new pair, registered again; the old pair is released once no write given up
        on reads it: ``settle`` raises otherwise).
        """
        if self._buffers is not None and self._buffers.capacity_bytes >= num_bytes:
            return
        self.settle("growing the staging buffers")
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
        """Deregister the buffers before their memory goes back to the allocator; one a
        write given up on may still read is neither (kept for the life of the process)."""
        if self._buffers is not None:
            for buffer in self._buffers.buffers:
                if self._late.reading(buffer):
                    quarantine(
                        buffer.tensor,
                        f"a {buffer.capacity_bytes}-byte staging buffer",
                        "a write given up on may still read it (engine ranks "
                        f"{sorted(self._late.targets)})",
                    )
                else:
                    self._transport.unregister(buffer.tensor)
            self._buffers = None

    @property
    def connected(self) -> Mapping[Runner, RankPublication]:
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
        wanted = {pub.runner: pub for pub in targets}
        stale = {key: pub for key, pub in self._connected.items() if wanted.get(key) != pub}
        keep = {(url, rank) for url, rank, _ in wanted} - {(url, rank) for url, rank, _ in stale}
        for gone in [k for k in self._writers if k not in keep]:
            self._writers.pop(gone).close()  # waits for a running write; queued ones cancelled
        self._forget(stale)
        if self._delta is not None:
            for key, old in stale.items():  # restarted, or its weights moved: full writes
                new = wanted.get(key)
                if (
                    new is None
                    or new.regions != old.regions
                    or new.reached_through != old.reached_through
                ):
                    self._delta.forget_target(key)
        for key, pub in wanted.items():
            self._transport.connect(pub)
            self._connected[key] = pub
            writer_key = pub.key
            if writer_key not in self._writers:
                self._writers[writer_key] = RankWriter(writer_key, self._transport, self._timeout_s)

    def disconnect(self) -> None:
        """Stop every writer and drop every transport connection (buffers stay registered)."""
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
        self._forget(dict(self._connected))

    def _forget(self, stale: Mapping[Runner, RankPublication]) -> None:
        """Drop these connections; a transport peer goes once no kept publication uses it."""
        for key in stale:
            del self._connected[key]
        kept = {pub.reached_through for pub in self._connected.values()}
        for pub in {pub.reached_through: pub for pub in stale.values()}.values():
            if pub.reached_through not in kept:
                self._transport.disconnect(pub)

    def run(
        self,
        plan: BytePlan,
        ready: Iterable[ReadyGroup],
        loaders: Mapping[Hashable, Loader],
        hooks: RunHooks | None = None,
    ) -> RunResult:
        """Stage and write every group ``ready`` yields, its bytes made by
        ``loaders[group.key]``; returns once all writes returned.

        A write that fails or is late fails its engine rank (``RunResult.failures``);
        any other exception (bad input, a loader error, an interrupt, a cancel) stops
        the run, and writes still running are kept for ``settle``. Before anything is
        staged, the writes earlier updates gave up on must have settled (``settle``).
        """
        self.settle("this update")
        if self._buffers is None or self._buffers.capacity_bytes < plan.buffer_bytes:
            raise TransferError(
                f"staging buffers of {self.buffer_bytes} bytes cannot hold the plan's largest "
                f"group ({plan.buffer_bytes} bytes); reserve() them first"
            )
        delta = self._delta.begin(self._connected) if self._delta is not None else None
        hooks = hooks or RunHooks()
        flags = None
        if hooks.flag_landed and delta is None:  # a delta changes parameters at the end
            flags = _LandedFlags(self._flag_bytes(), hooks.flag_landed)
        update = _Run(
            plan,
            self._buffers,
            self._writers,
            self._timeout_s,
            loaders,
            self._transport,
            hooks,
            delta,
            FullHeaders(self._connected),
            flags,
        )
        try:
            for group, inputs in ready:
                update.stage(group, inputs)
            result = update.finish()
        except BaseException:
            update.abort()
            self.forget_deltas()
            raise
        finally:
            self._late.extend(update.late)  # they may still read the buffers
        if self._delta is not None and delta is not None:
            self._delta.finish(
                delta,
                result.failures,
                compare_s=result.delta_s,
                wait_s=result.wait_s,
                compare_paused_s=result.delta_paused_s,
            )
            result.delta = summary = delta.summary
            logger.info(
                "p2pweights delta update: %d of %d bytes written (%.1f %%): %d parameter(s) "
                "as deltas, %d in full, %d unchanged; the previous update's copy takes %d "
                "bytes; %s",
                summary.sent_bytes,
                summary.full_bytes,
                100 * summary.fraction,
                summary.num_delta_slots,
                summary.num_full_slots,
                summary.num_unchanged_slots,
                summary.store_bytes,
                delta.decision.describe(),
            )
        return result

    def forget_deltas(self) -> None:
        """An update failed (here, or in a later step such as the engines' end): the
        next one is written in full (``SyncConfig.delta``)."""
        if self._delta is not None:
            self._delta.forget()

    @property
    def unsettled_targets(self) -> frozenset[TargetKey]:
        """Engine ranks a write given up on may still land in (as of the last ``settle``):
        torn until it settled, whatever a later update wrote there."""
        return self._late.targets

    def settle(self, refused: str = "reusing their staging buffer") -> None:
        """Before the buffers are reused or released, let the writes failed updates gave up
        on end; raises ``TransferError`` naming the engine ranks of those still in flight
        after ``timeouts.transfer`` (their buffers stay out of use until they end)."""
        unsettled = self._late.settle(self._timeout_s)
        if unsettled:
            raise still_in_flight(unsettled, self._timeout_s, refused)

    def _flag_bytes(self) -> torch.Tensor:
        if self._flag_source is None:
            source = torch.ones(64, dtype=torch.uint8, device=self._device)
            self._transport.register(source)
            self._flag_source = source
        return self._flag_source

    def close(self) -> None:
        """Stop the writers (a running write returns within its timeout) and drop the
        buffers, except those a write given up on may still read (never freed)."""
        self.disconnect()
        self._late.settle(0.0)
        self._release_buffers()
        if self._flag_source is not None and not self._late.targets:
            self._transport.unregister(self._flag_source)  # else kept: a flag may still read it
            self._flag_source = None


@dataclass
class _DirectLoad:
    """Groups of one replica an engine rank receives straight into its memory, each with
    the views of its slots and the plan they were taken from (the load phase takes them
    again from its own plan where that moved since)."""

    runner: Runner
    groups: list[tuple[GroupPlan, BytePlan, dict[str, torch.Tensor]]] = field(default_factory=list)
    inputs: list[HfInput] = field(default_factory=list)


class _LandedFlags:
    """The flag writes that tell engine ranks which parameters' writes landed."""

    def __init__(self, source: torch.Tensor, urls: frozenset[str]) -> None:
        self._source = source.data_ptr()
        self._urls = urls
        self._offsets: dict[int, dict[str, int]] = {}

    def batch(self, landed: WriteBatch) -> WriteBatch | None:
        """The flags of the parameters ``landed`` wrote, to its target; None where the
        target publishes no flags or is not flagged."""
        target = landed.target
        offsets = self._flag_offsets(target)
        if offsets is None:
            return None
        flags = target.regions[LANDED_NAME]
        out = WriteBatch(target)
        for param in dict.fromkeys(landed.params):
            at = offsets.get(param)
            if at is not None:
                out.add(Write(self._source, flags.address + at, 1, flags.gpu_id), f"{param} (flag)")
        return out if out.writes else None

    def set_directly(
        self, target: RankPublication, params: list[str], transport: Transport
    ) -> None:
        """Flag ``params``, which a direct load's finished copies wrote, through the
        transport's own mapping of ``target``'s memory (a device copy, after them)."""
        offsets = self._flag_offsets(target)
        if offsets is None:
            return
        flags = target.regions[LANDED_NAME]
        view = transport.direct_view(target, flags.address, flags.num_bytes)
        if view is None:
            return
        at = [offsets[param] for param in params if param in offsets]
        if at:
            view[torch.tensor(at, device=view.device)] = 1

    def _flag_offsets(self, target: RankPublication) -> dict[str, int] | None:
        """Parameter -> its flag's offset in ``target``'s flags region; None where the
        target publishes no flags (or too few) or is not flagged."""
        flags = target.regions.get(LANDED_NAME)
        if flags is None or target.engine_url not in self._urls:
            return None
        offsets = self._offsets.get(id(target))
        if offsets is None:
            names = flag_names(target.regions)
            if len(names) > flags.num_bytes:  # too few flags published: flag nothing
                return None
            offsets = self._offsets[id(target)] = {name: i for i, name in enumerate(names)}
        return offsets


@dataclass(frozen=True)
class _Placed:
    """A group staged in the current buffer at ``base``, for these engine ranks."""

    group: GroupPlan
    base: int
    targets: frozenset[Runner]


class _Run:
    """One update's staging state: what is staged in the current buffer, writes, futures."""

    def __init__(
        self,
        plan: BytePlan,
        buffers: StagingBuffers,
        writers: dict[TargetKey, RankWriter],
        timeout_s: float,
        loaders: Mapping[Hashable, Loader],
        transport: Transport,
        hooks: RunHooks,
        delta: DeltaRun | None = None,
        full_headers: FullHeaders | None = None,
        flags: _LandedFlags | None = None,
    ):
        self._plan = plan
        self._flags = flags
        self._buffers = buffers
        self._writers = writers
        self._timeout_s = timeout_s
        self._loaders = loaders
        self._transport = transport
        self._hooks = hooks
        self._delta = delta
        # Whose headers the last flush writes to the ranks publishing a scratch region.
        self._headers: DeltaRun | FullHeaders | None = delta if delta is not None else full_headers
        # Where the last flush's buffer holds the delta headers (reserved by ``finish``).
        self._header_at: int | None = None
        self._opened = hooks.before_writes is None
        buffers.reset()
        self._staged: dict[Hashable, tuple[list[HfInput], dict[str, torch.Tensor]]] = {}
        self._placed: list[_Placed] = []
        # loads straight into engine memory, per (replica, engine rank and runner)
        self._direct: dict[tuple[Hashable, Runner], _DirectLoad] = {}
        self._direct_bytes: dict[Runner, int] = defaultdict(int)
        # GPUs direct loads queued copies on: synchronized before the run returns or fails.
        self._direct_devices: set[torch.device] = set()
        self._pending: dict[int, list[tuple[Future[None], WriteBatch]]] = {0: [], 1: []}
        self._failed = FailedTargets()
        self.result = RunResult()
        self._staged_digests = StagedDigests()
        # Writes given up on (late, or unsettled in the transport), with their buffers.
        self.late = LateWrites()

    def stage(self, group: GroupPlan, inputs: Sequence[HfInput]) -> None:
        """Phase 1, per group: reserve its block in the current buffer for the ranks written
        through staging, or queue it for the ranks loaded directly (both may flush)."""
        self._raise_if_cancelled()
        self._stop_if_every_rank_failed()
        plan = self._plan  # the plan may have been replaced by the first open
        group = plan.group(group.key, group.index)
        staged = []
        for tw in group.targets:
            key = tw.target.runner
            if self._failed.get(key.key) is not None:
                continue  # this rank already failed; the others carry on
            try:
                views = self._direct_views(group, tw)
            except TransferError as exc:  # refused for this rank alone, as a failed write
                self._failed.record(key.key, exc)
                continue
            if views is None:
                staged.append(key)
            else:
                self._queue_direct(plan, group, key, inputs, views)
        if staged:
            self._stage(group, inputs, frozenset(staged))
        if self._hooks.progress is not None:
            self._hooks.progress(group.block_bytes * len(group.targets))

    def _queue_direct(
        self,
        plan: BytePlan,
        group: GroupPlan,
        runner: Runner,
        inputs: Sequence[HfInput],
        views: dict[str, torch.Tensor],
    ) -> None:
        """Queue a direct load, with the views ``plan`` gave it; a flush first where the
        queue would pass a buffer's size (it bounds a load's replay-check scratch)."""
        if self._direct_bytes[runner] + group.block_bytes > self._buffers.current.capacity_bytes:
            self._flush()  # may open the engines: the load phase re-maps against its plan
        direct = self._direct.setdefault((group.key, runner), _DirectLoad(runner))
        direct.groups.append((group, plan, views))
        direct.inputs.extend(inputs)
        self._direct_bytes[runner] += group.block_bytes

    def _raise_if_cancelled(self) -> None:
        if self._hooks.cancel is not None and self._hooks.cancel.is_set():
            raise TransferError("the update was cancelled by abort() from another thread")

    def _stop_if_every_rank_failed(self) -> None:
        """Every engine rank this trainer rank writes has failed: fail the update now
        instead of reading the rest of the input for nothing (a streamed update may take
        seconds to end). While some rank is healthy, it still gets every byte."""
        failed = self._failed.errors()
        if not failed or not set(self._writers) <= failed.keys():
            return
        errors = list(failed.values())
        raise TransferError(
            f"every engine rank this trainer rank writes failed ({len(errors)}), so the update "
            f"stopped before its input ended: {some_of(errors)}"
        ) from errors[0]

    def _direct_views(self, group: GroupPlan, tw: TargetWrites) -> dict[str, torch.Tensor] | None:
        """The engine rank's memory for every slot of ``group``, if the transport maps it
        for plain copies (a load writes every slot of its group: all or none)."""
        if group.partial or {w.slot for w in tw.writes} != set(range(len(group.slots))):
            return None  # an owner's share of a group is staged (zeroed first), not loaded there
        views = {}
        for w in tw.writes:
            slot = group.slots[w.slot]
            view = self._transport.direct_view(tw.target, w.dst_address, slot.num_bytes)
            if view is None:
                return None
            views[slot.param] = view
        return views

    def _stage(
        self, group: GroupPlan, inputs: Sequence[HfInput], targets: frozenset[Runner]
    ) -> None:
        buffer = self._buffers.current
        if buffer.capacity_bytes - buffer.used_bytes < group.block_bytes:
            buffer = self._flush()
        base = buffer.reserve(group.block_bytes)
        assert base is not None  # the plan sized the buffers for its largest block
        staged_inputs, views = self._staged.setdefault(group.key, ([], {}))
        staged_inputs.extend(inputs)
        for slot in group.slots:
            views[slot.param] = buffer.view(base + slot.offset, slot.num_bytes)
        self._placed.append(_Placed(group, base, targets))

    def _flush(self) -> StagingBuffer:
        """Load and send the current buffer; return the other one once its writes returned.

        A write given up on (late, or unsettled in the transport) may still read the
        buffer returned: it is refilled all the same, so that one stuck engine rank does
        not hold the others' writes. That write's rank failed in this run: it takes no
        other write, stays torn (never resumed, never verified) and is settled before any
        later update writes anything (``TransferExecutor.settle``), so the refill changes
        only which stale bytes may still land in that torn rank; the buffer stays
        registered until the write settled (``LateWrites``)."""
        self._raise_if_cancelled()
        buffer = self._buffers.current
        placed, self._placed = self._placed, []
        self._load_staged(buffer, placed)  # phase 1: no engine touched yet
        digested = self._compare_before_open(buffer, placed)  # while the engines generate
        # The buffer that opens the engines is hashed before it does, while they still
        # generate (its writes then start later, but the pause is shorter by the hashing);
        # any later one while its writes run, as is every buffer of a run whose engines
        # were paused before it began (``paused_before``: hashing first would only delay
        # the writes inside the pause). Delta entries replace slot bytes when placed:
        # there the slots were digested before (``_compare_before_open``).
        early = not self._opened and not self._hooks.paused_before and self._delta is None
        if early:
            self._hash_staged(buffer, placed, digested)
        plan = self._open()  # phase 2: every later phase of this flush runs against ``plan``
        self._place(buffer)  # phase 3
        self._write(buffer, placed, plan)  # phase 4
        if not early:  # while the writers send the same bytes; before the buffer is refilled
            self._hash_staged(buffer, placed, digested)
        self._load_direct(plan)  # while the writers send the staged bytes
        self.result.num_flushes += 1
        return self._settle_other()  # phase 5

    def _hash_staged(
        self, buffer: StagingBuffer, placed: Sequence[_Placed], digested: bool
    ) -> None:
        """The write digests (unless ``digested`` already) and weight-checker hashes of the
        slots staged in ``buffer``, as the run's hooks ask."""
        if self._hooks.digest_staged and not digested:
            self._digest(buffer, placed)
        if self._hooks.checksums:
            self._hooks.checksums.add_spans(
                buffer.tensor,
                (
                    (slot.param, p.base + slot.offset, slot.num_bytes, p.targets)
                    for p in placed
                    for slot in p.group.slots
                ),
            )

    def _load_staged(self, buffer: StagingBuffer, placed: Sequence[_Placed]) -> None:
        """The loaders fill the staged groups' bytes in ``buffer`` (plan-free: slot offsets);
        an owner's share of a group (``GroupPlan.partial``) has the other owners' bytes
        zeroed, so the shares' digests add up."""
        started = time.perf_counter()
        with contextlib.ExitStack() as scope:
            if not buffer.tensor.is_cuda:
                scope.enter_context(one_intra_op_thread())
            for key, (inputs, views) in self._staged.items():
                self._loaders[key].load_into(inputs, views)
        self._staged = {}
        for share in placed:
            for start, end in share.group.unwritten():
                buffer.view(share.base + start, end - start).zero_()
        if buffer.tensor.is_cuda:
            # Loaders copy asynchronously on the GPU; writers must read finished bytes.
            torch.cuda.current_stream(buffer.tensor.device).synchronize()
        self.result.load_s += time.perf_counter() - started

    def _compare_before_open(self, buffer: StagingBuffer, placed: Sequence[_Placed]) -> bool:
        """With deltas: compare the slots just loaded with the previous update's (and digest
        them first where entries will replace them). Whether they were digested."""
        if self._delta is None:
            return False
        digested = False
        if self._hooks.digest_staged and self._delta.decision.mode == "delta":
            self._digest(buffer, placed)  # of the slots' bytes, before entries replace them
            digested = True
        self._compare_deltas(buffer, placed)
        return digested

    def _place(self, buffer: StagingBuffer) -> None:
        """With deltas: pack the entries, decided against the publications current now."""
        if self._delta is None:
            return
        with contextlib.ExitStack() as scope:
            if not buffer.tensor.is_cuda:
                scope.enter_context(one_intra_op_thread())
            self._delta.place(buffer.view)
        if buffer.tensor.is_cuda:  # entries are packed by device copies; writers (own
            # streams, or the network) must read them finished
            torch.cuda.current_stream(buffer.tensor.device).synchronize()

    def _write(self, buffer: StagingBuffer, placed: Sequence[_Placed], plan: BytePlan) -> None:
        """Hand each runner's batch of ``buffer`` to its rank's writer, to where ``plan``
        says."""
        index = self._buffers.current_index
        for batch in self._batches(buffer, placed, plan):
            if self._failed.get(batch.key) is not None:
                continue  # this rank already failed; the others carry on
            future = self._writers[batch.key].submit(batch, self._failed)
            self._pending[index].append((future, batch))
            self.result.bytes_by_target[batch.key] += batch.num_bytes

    def _settle_other(self) -> StagingBuffer:
        """Swap buffers; the other one is returned once the writes reading it returned or
        were given up on (their ranks failed)."""
        index = self._buffers.current_index
        buffer = self._buffers.swap()
        landed = self._wait(1 - index)
        if self._flags is not None:  # queued behind this flush's writes to each rank
            self._flag(landed, index)
        buffer.used_bytes = 0
        return buffer

    def _digest(self, buffer: StagingBuffer, placed: Sequence[_Placed]) -> None:
        """Each staged slot's digest, filed under every runner it is written to."""
        started = time.perf_counter()
        with contextlib.ExitStack() as scope:
            if not buffer.tensor.is_cuda:  # beside the writer threads: see intra_op
                scope.enter_context(one_intra_op_thread())
            for partial in (False, True):  # an owner's share of a group: summed with the others'
                self._staged_digests.add_spans(
                    buffer.tensor,
                    (
                        (slot.param, p.base + slot.offset, slot.num_bytes, p.targets)
                        for p in placed
                        if p.group.partial == partial
                        for slot in p.group.slots
                    ),
                    partial=partial,
                )
        self.result.digest_s += time.perf_counter() - started

    def _compare_deltas(self, buffer: StagingBuffer, placed: Sequence[_Placed]) -> None:
        """Delta entries of the slots just loaded (``DeltaRun.place`` packs them)."""
        assert self._delta is not None
        started = time.perf_counter()
        with contextlib.ExitStack() as scope:
            if not buffer.tensor.is_cuda:  # beside the writer threads: see intra_op
                scope.enter_context(one_intra_op_thread())
            self._compare(buffer, placed)
        if buffer.tensor.is_cuda:
            torch.cuda.current_stream(buffer.tensor.device).synchronize()
        seconds = time.perf_counter() - started
        self.result.delta_s += seconds
        if self._opened or self._hooks.paused_before:
            self.result.delta_paused_s += seconds

    def _compare(self, buffer: StagingBuffer, placed: Sequence[_Placed]) -> None:
        assert self._delta is not None
        self._delta.compare(
            (
                (
                    p.group.key,
                    id(p),
                    [(s.param, p.base + s.offset, s.num_bytes) for s in p.group.slots],
                    p.targets,
                )
                for p in placed
            ),
            buffer.view,
            self._elem_size,
        )

    def _elem_size(self, key: Hashable, param: str) -> int:
        """Bytes per element of ``param`` as the replica lays it out (1 if unknown)."""
        layouts = getattr(self._loaders[key], "layouts", None)
        layout = None if layouts is None else layouts.get(param)
        return 1 if layout is None else int(layout.dtype.itemsize)

    def _open(self) -> BytePlan:
        """Phase 2, once per run before anything reaches an engine: ``before_writes``. A
        new plan it returns (new addresses for the same groups) is the plan every later
        phase runs against; returns the plan current now."""
        if not self._opened:
            self._opened = True
            assert self._hooks.before_writes is not None
            plan = self._hooks.before_writes()
            if plan is not None:
                self._plan = plan
        return self._plan

    def _batches(
        self, buffer: StagingBuffer, placed_groups: Sequence[_Placed], plan: BytePlan
    ) -> list[WriteBatch]:
        """The writes of the groups placed in ``buffer``, one batch per runner, to where
        ``plan`` says (a runner's draft is reached through its own handle)."""
        batches: dict[Runner, WriteBatch] = {}
        for placed in placed_groups:
            group = plan.group(placed.group.key, placed.group.index)
            start = buffer.address + placed.base
            for tw in group.targets:
                key = tw.target.runner
                if key not in placed.targets:
                    continue
                batch = batches.get(key)
                if batch is None:
                    batch = batches[key] = WriteBatch(tw.target)
                for w in tw.writes:
                    slot = group.slots[w.slot]
                    instead = None if self._delta is None else self._delta.slot(id(placed), w.slot)
                    if instead is not None:  # a delta entry, or unchanged: nothing to write
                        if instead.num_bytes:
                            address, gpu_id = instead.dst[key]
                            write = Write(start + slot.offset, address, instead.num_bytes, gpu_id)
                            batch.add(write, f"{slot.param} (delta)")
                        continue
                    at = start + slot.offset + w.src_offset
                    batch.add(Write(at, w.dst_address, w.length(slot), w.dst_device), slot.param)
        if self._header_at is not None:
            self._add_headers(buffer, batches)
        return [batch for batch in batches.values() if batch.writes]

    def _add_headers(self, buffer: StagingBuffer, batches: dict[Runner, WriteBatch]) -> None:
        """Each scratch-publishing runner's delta header, written by the last flush."""
        assert self._headers is not None and self._header_at is not None
        for i, (runner, header) in enumerate(self._headers.headers().items()):
            offset = self._header_at + i * HEADER_BYTES
            pack_header(header, buffer.view(offset, HEADER_BYTES))
            pub = self._headers.scratch[runner]
            scratch = pub.regions[SCRATCH_NAME]
            batch = batches.get(runner)
            if batch is None:
                batch = batches[runner] = WriteBatch(pub)
            batch.add(
                Write(buffer.address + offset, scratch.address, HEADER_BYTES, scratch.gpu_id),
                "delta header",
            )
        self._header_at = None

    def _direct_views_in(self, plan: BytePlan, direct: _DirectLoad) -> dict[str, torch.Tensor]:
        """The memory a direct load writes, as ``plan`` maps it: views taken from another
        plan (queued before the first open moved it) are taken again."""
        views: dict[str, torch.Tensor] = {}
        for old, taken_from, taken in direct.groups:
            if taken_from is plan:
                views.update(taken)
                continue
            group = plan.group(old.key, old.index)
            tw = next(t for t in group.targets if t.target.runner == direct.runner)
            again = self._direct_views(group, tw)
            if again is None:
                raise TransferError(f"{tw.target.where}: its memory is no longer mapped")
            views.update(again)
        return views

    def _load_direct(self, plan: BytePlan) -> None:
        """Load the direct groups into the engines' memory where ``plan`` says, and wait for
        the copies: an engine reads its memory once ``end_weight_update`` returns."""
        started = time.perf_counter()
        loaded: list[tuple[RankPublication, list[str]]] = []
        for (key, target), direct in self._direct.items():
            if self._failed.get(target.key) is not None:
                continue
            try:
                views = self._direct_views_in(plan, direct)
            except TransferError as exc:  # this rank alone fails, as for a failed write
                self._failed.record(target.key, exc)
                continue
            self._direct_devices.update(v.device for v in views.values() if v.is_cuda)
            self._loaders[key].load_into(direct.inputs, views)
            num_bytes = sum(v.numel() for v in views.values())
            self.result.bytes_by_target[target.key] += num_bytes
            if self._hooks.digest_staged:  # in the copies' stream order: nothing waits here
                digest_started = time.perf_counter()
                self._staged_digests.add((param, view, (target,)) for param, view in views.items())
                self.result.digest_s += time.perf_counter() - digest_started
            if self._hooks.checksums:  # the copies are done first (the GPU hash waits)
                self._hooks.checksums.add((param, view, (target,)) for param, view in views.items())
            if self._flags is not None:
                loaded.append((self._publication(plan, direct), list(views)))
        self._direct = {}
        self._direct_bytes.clear()
        self._sync_direct()
        if self._flags is not None:  # the copies are done: their parameters landed
            for pub, params in loaded:
                self._flags.set_directly(pub, params, self._transport)
        self.result.load_s += time.perf_counter() - started

    @staticmethod
    def _publication(plan: BytePlan, direct: _DirectLoad) -> RankPublication:
        """The publication ``plan`` writes ``direct``'s runner through."""
        old = direct.groups[0][0]
        group = plan.group(old.key, old.index)
        return next(t.target for t in group.targets if t.target.runner == direct.runner)

    def _sync_direct(self) -> None:
        for device in self._direct_devices:
            torch.cuda.current_stream(device).synchronize()
        self._direct_devices.clear()

    def finish(self) -> RunResult:
        if self._headers is not None and self._headers.max_headers:
            # every scratch-publishing rank gets this update's header in the last flush
            # (without deltas one without entries: no payload left there is applied)
            need = HEADER_BYTES * self._headers.max_headers
            buffer = self._buffers.current
            if buffer.capacity_bytes - buffer.used_bytes < need:
                buffer = self._flush()
            self._header_at = buffer.reserve(need)
        if self._placed or self._staged or self._direct or self._header_at is not None:
            self._flush()  # the last: its writes are waited for below
        self._open()  # a run that wrote nothing still opens, once
        for index in (0, 1):
            self._wait(index)
        self._buffers.current.used_bytes = 0
        self.result.failures = self._failed.errors()
        # the sums of what direct loads wrote are taken before the engines end their
        # sessions (an engine's postprocess may rewrite its weights in place) or a failed
        # update unmaps their memory: only the last flush's are still running here
        self._staged_digests.settle()
        if self._hooks.digest_staged:  # hashed when asked for (``RunResult.digests``)
            self.result.staged_digests = self._staged_digests
        if self._hooks.checksums:
            self.result.checksums = self._hooks.checksums.found
            self.result.checksum_s = self._hooks.checksums.seconds
        return self.result

    def abort(self) -> None:
        """Cancel queued writes; keep the others in ``late`` (running ones still read the
        buffers; finished ones may have given up unsettled). Copies a direct load queued
        are waited for, and the sums taken of what they wrote: the engine's memory may be
        closed next."""
        with contextlib.suppress(Exception):  # the run failed already; report that error
            self._sync_direct()
        with contextlib.suppress(Exception):
            self._staged_digests.settle()
        for index, pending in self._pending.items():
            for future, batch in pending:
                if not future.cancel():
                    self.late.add(future, batch, self._buffers.buffers[index])
            pending.clear()

    def _flag(self, landed: Sequence[WriteBatch], index: int) -> None:
        """Write the landed flags of ``landed``'s parameters to their engine ranks; waited
        for with the writes of buffer ``index``."""
        assert self._flags is not None
        for batch in landed:
            flags = self._flags.batch(batch)
            if flags is not None and self._failed.get(batch.key) is None:
                future = self._writers[batch.key].submit(flags, self._failed)
                self._pending[index].append((future, flags))

    def _wait(self, index: int) -> list[WriteBatch]:
        """Wait for the writes reading buffer ``index``; failures are recorded per engine
        rank, not raised, and writes given up on are kept in ``late`` with the buffer.
        Returns the batches that landed."""
        pending = self._pending[index]
        if not pending:
            return []
        landed = []
        buffer = self._buffers.buffers[index]
        started = time.perf_counter()
        _, not_done = wait([future for future, _ in pending], timeout=self._timeout_s)
        self.result.wait_s += time.perf_counter() - started
        for future, batch in pending:
            if future in not_done:
                self.late.add(future, batch, buffer)
                self._failed.record(
                    batch.key,
                    TransferError(
                        f"write to {batch.describe()} still running after "
                        f"timeouts.transfer={self._timeout_s}"
                    ),
                )
            elif future.cancelled():  # never ran: its writer was closed meanwhile
                self._failed.record(batch.key, closed_writer(batch))
            elif future.exception() is not None:
                if isinstance(future.exception(), UnsettledWrite):
                    self.late.add(future, batch, buffer)  # it may still read the buffer
                self._failed.record(batch.key, future.exception())  # type: ignore[arg-type]
            else:
                landed.append(batch)
        pending.clear()
        return landed
