"""``WeightSyncSession``: connect to engines once, then push every training step's weights.

The session only sequences. Connecting (``engines.fleet``), planning
(``plan.assignment``), the replicas (``replica``), grouping inputs
(``plan.inputs``), staging and writing (``transfer.pipeline``) live elsewhere.

One update, as sglang expects it::

    pause_generation -> flush_cache -> begin_weight_update -> writes
    -> update_weight_version -> end_weight_update -> continue_generation

With several sending trainer ranks, trainer rank 0 drives the engines' update
session; after each step (open, write, close) all ranks ``agree`` on whether every
one of them succeeded, so the others write only inside the open session and all
ranks fail together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import TypeVar

import torch

from p2pweights.config import SyncConfig
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectedEngine, Fleet
from p2pweights.engines.published import RankPublication
from p2pweights.errors import ConfigError, TransferError
from p2pweights.plan.assignment import Target, assign_targets
from p2pweights.replica.registry import ReplicaHandle, replica_for
from p2pweights.report import UpdateReport
from p2pweights.source.checkpoint_format import CheckpointFormat, unify
from p2pweights.source.inputs import (
    ConvertingCollector,
    InputSpec,
    ParamGroup,
    check_input,
    describe_inputs,
)
from p2pweights.transfer.buffers import StagingBuffers
from p2pweights.transfer.pipeline import PipelineStats, UpdatePipeline
from p2pweights.transfer.transports import Transport, create_transport
from p2pweights.transfer.writers import EngineWriter

logger = logging.getLogger(__name__)
T = TypeVar("T")

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


class WeightSyncSession:
    """Pushes a trainer's HF-named tensors into connected sglang engines, point to point."""

    def __init__(
        self,
        config: SyncConfig | None = None,
        *,
        agree: Callable[[bool], bool] | None = None,
        staging_device: torch.device | str = "cpu",
    ):
        """``agree(ok)`` must return whether every sending trainer rank passed ``True``
        (an all-reduce of the flags, e.g. ``p2pweights.adapters.torch_agree()``); it is
        required with ``num_trainer_ranks > 1``. ``staging_device`` places the staging
        buffers ("cpu": pinned host memory; "cuda:N" where the transport reads GPU memory).
        """
        self.config = config or SyncConfig()
        if self.config.num_trainer_ranks > 1 and agree is None:
            raise ConfigError(
                "with num_trainer_ranks > 1 pass agree= (e.g. p2pweights.adapters.torch_agree()) "
                "so all trainer ranks write inside the session rank 0 opens and fail together"
            )
        self._agree = agree or (lambda ok: ok)
        self._staging_device = torch.device(staging_device)
        self._transport: Transport | None = None
        self._fleet = Fleet([])
        self._replicas: dict[Hashable, ReplicaHandle] = {}
        self._targets: dict[Hashable, list[RankPublication]] = {}
        self._writers: dict[str, EngineWriter] = {}
        self._buffers: StagingBuffers | None = None
        self._unfinished: list[Future[None]] = []
        self._groups: dict[Hashable, list[ParamGroup]] | None = None
        self._formats: dict[Hashable, CheckpointFormat] = {}
        self._inputs: dict[str, InputSpec] = {}
        self._next_version = 1
        self._session_open = False  # engines paused inside begin/end (after a failed update)
        self._snapshot_taken = False
        self._checked = False

    @property
    def _leader(self) -> bool:
        return self.config.trainer_rank == 0

    # -- connect -------------------------------------------------------------------------------

    def connect(self, engines: Sequence[str | EngineEndpoint]) -> None:
        """Read every engine's layout and published weights; prepare this rank's targets.

        Refuses, before any byte moves, engines published for another transport and
        engines whose published parameter sizes differ from the replica's. Engines are
        ordered by URL, so every trainer rank plans the same way whatever order it lists
        them in. A failed connect leaves the session unconnected.
        """
        if not engines:
            raise ConfigError("connect() needs at least one engine URL")
        endpoints = sorted((EngineEndpoint.of(e) for e in engines), key=lambda e: e.url)
        if len({e.url for e in endpoints}) != len(endpoints):
            raise ConfigError("each engine may be listed once")
        self._disconnect()
        fleet = Fleet.connect(
            endpoints, self.config.transport.kind, self.config.http_timeout_s, self.config.api_key
        )
        try:
            if self._transport is None:
                self._transport = create_transport(self.config.transport)
            targets = self._plan(fleet)
        except BaseException:
            fleet.close()
            raise
        self._fleet, self._targets = fleet, targets
        self._writers = {
            url: EngineWriter(url, self._transport, self.config.transfer_timeout_s)
            for url in sorted({pub.engine_url for pubs in targets.values() for pub in pubs})
        }
        self._next_version = max(self._next_version, fleet.next_numeric_version())
        logger.info(
            "connected to %d engine(s); trainer rank %d writes %d engine rank(s), %d replica(s)",
            len(fleet.engines),
            self.config.trainer_rank,
            sum(len(pubs) for pubs in targets.values()),
            len(targets),
        )

    def _plan(self, fleet: Fleet) -> dict[Hashable, list[RankPublication]]:
        """This trainer rank's targets by replica, each checked and connected."""
        assert self._transport is not None
        handles = {
            (e.index, rank): self._replica(e, rank)
            for e in fleet.engines
            for rank in range(e.num_ranks)
        }
        plan = assign_targets(
            self.config.num_trainer_ranks,
            [Target(i, rank, layout_key=h.key) for (i, rank), h in handles.items()],
        )
        targets: dict[Hashable, list[RankPublication]] = {}
        for target in plan[self.config.trainer_rank]:
            engine = fleet.engines[target.engine_index]
            # the sender of an engine rank also writes its speculative draft, if any
            pubs = [engine.publications[target.engine_rank]]
            if engine.draft_publications:
                pubs.append(engine.draft_publications[target.engine_rank])
            for pub in pubs:
                handle = self._replica(engine, target.engine_rank, pub.role)
                handle.check_published(pub)
                self._transport.connect(pub)
                targets.setdefault(handle.key, []).append(pub)
        return targets

    def _replica(self, engine: ConnectedEngine, rank: int, role: str = "target") -> ReplicaHandle:
        handle = replica_for(engine.server_info, rank, engine.endpoint.model_path, role)
        return self._replicas.setdefault(handle.key, handle)

    # -- update --------------------------------------------------------------------------------

    def update(self, named_tensors: NamedTensors, *, version: str | None = None) -> UpdateReport:
        """Write ``(hf_name, tensor)`` pairs (checkpoint names) into every connected engine.

        Returns once every engine runs the new weights; raises if any write failed,
        was refused or is still running after ``transfer_timeout_s``. A Mapping or a
        sequence is checked whole before any byte is written; an iterator is checked
        tensor by tensor (the first update always reads it whole to probe the loaders).
        Tensors must stay unchanged until ``update`` returns: bytes are loaded from
        them when their staging buffer is flushed, not when they are yielded.
        After a failed update the engines stay paused in their update session; the
        next ``update`` rewrites every weight and then resumes them.
        """
        if not self._fleet.engines:
            raise ConfigError("call connect(engines) before update()")
        started = time.perf_counter()
        stages: dict[str, float] = {}
        self._settle_failed_writes()
        tensors = _pairs(named_tensors)
        if self._groups is None or not isinstance(tensors, Iterator):
            tensors = list(tensors)
            with _timed(stages, "probe" if self._groups is None else "check_inputs"):
                self._prepare(tensors)
        version = version or str(self._next_version)
        with _timed(stages, "control_plane"):
            self._step("open", self._open_update)
        stats = self._step("write", lambda: self._write_all(tensors, stages))
        self._next_version = _next_version_after(version, self._next_version)
        self._step("close", lambda: self._close_update(version, stages))
        stages["load"], stages["wait"] = stats.load_s, stats.wait_s
        report = UpdateReport(
            version=version,
            bytes_by_target=dict(stats.bytes_by_target),
            stage_seconds=stages,
            seconds=time.perf_counter() - started,
        )
        logger.info("p2pweights update %s", report.summary())
        return report

    def _step(self, name: str, action: Callable[[], T]) -> T:
        """Run ``action``; every trainer rank learns whether all of them succeeded."""
        error: BaseException | None = None
        try:
            result = action()
        except BaseException as exc:
            error = exc
        if not self._agree(error is None):
            if error is not None:
                raise error
            raise TransferError(
                f"trainer rank {self.config.trainer_rank}: another trainer rank failed the "
                f"'{name}' step of this update (its error names the engine)"
            )
        return result

    def _prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Check the whole input; on the first update also probe the loaders."""
        specs = describe_inputs(tensors)
        if self._groups is None:
            keys = sorted(self._targets, key=str)
            formats = unify({key: self._replicas[key].checkpoint_format(specs) for key in keys})
            groups = {
                key: self._replicas[key].groups(formats[key].engine_specs(specs)) for key in keys
            }
            for key in keys:
                self._replicas[key].check_writable(groups[key], self._targets[key])
            self._formats, self._groups = formats, groups
            self._inputs = specs
            self._ensure_buffers()
        for name, tensor in tensors:
            check_input(name, tensor, self._inputs)
        missing = sorted(set(self._inputs) - set(specs))
        if missing:
            raise ConfigError(
                f"this update lacks {len(missing)} HF tensor(s) the first update sent: "
                f"{', '.join(missing[:8])}"
            )

    def _ensure_buffers(self) -> None:
        """Staging buffers that hold the largest group of any of this rank's replicas."""
        assert self._groups is not None and self._transport is not None
        if not self._targets:
            return  # an idle trainer rank stages nothing
        largest = max(
            (
                self._replicas[key].group_bytes(group)
                for key, groups in self._groups.items()
                for group in groups
            ),
            default=0,
        )
        size = max(self.config.buffer_bytes, largest)
        if self._buffers is None or self._buffers.capacity_bytes < size:
            self._buffers = StagingBuffers(size, self._staging_device, self._transport.register)

    def _write_all(
        self, tensors: Iterable[tuple[str, torch.Tensor]], stages: dict[str, float]
    ) -> PipelineStats:
        assert self._groups is not None
        if self._buffers is None:
            return PipelineStats()  # an idle trainer rank writes nothing
        pipeline = UpdatePipeline(
            self._buffers,
            self._writers,
            self.config.transfer_timeout_s,
            lambda key, inputs, views: self._replicas[key].load_into(inputs, views),
        )
        collector = ConvertingCollector(self._groups, self._formats)
        try:
            streamed = isinstance(tensors, Iterator)  # a list was checked whole in _prepare
            for name, tensor in tensors:
                if streamed:
                    check_input(name, tensor, self._inputs)
                for key, group, inputs in collector.add(name, tensor):
                    sizes = self._replicas[key].group_sizes(group)
                    pipeline.stage(key, sizes, inputs, self._targets[key])
            collector.raise_if_incomplete()
            return pipeline.finish()
        except BaseException:
            # Running writes may still read the buffers: keep them until those return.
            self._unfinished = pipeline.abort()
            raise
        finally:
            if collector.convert_s:
                stages["convert"] = collector.convert_s

    def _settle_failed_writes(self) -> None:
        """Before reusing the buffers, let the writes of a failed update return."""
        if not self._unfinished:
            return
        _, running = wait(self._unfinished, timeout=self.config.transfer_timeout_s)
        if running:
            raise TransferError(
                f"{len(running)} write(s) of the last, failed update are still running after "
                f"transfer_timeout_s={self.config.transfer_timeout_s}; an engine is stuck. "
                f"close() this session and connect a new one"
            )
        self._unfinished = []

    def _open_update(self) -> None:
        if not self._leader or self._session_open:
            return  # after a failed update the engines are still paused and open
        check = self.config.check_weight_update_equal and not self._snapshot_taken
        self._fleet.open_update(self.config.pause_mode, snapshot=check)
        self._snapshot_taken = self._snapshot_taken or check
        self._session_open = True

    def _close_update(self, version: str, stages: dict[str, float]) -> None:
        if not self._leader:
            return
        with _timed(stages, "control_plane"):
            self._fleet.close_update(version)
        if self.config.check_weight_update_equal and not self._checked:
            with _timed(stages, "verify"):
                self._fleet.compare()
            self._checked = True
        with _timed(stages, "control_plane"):
            self._fleet.resume()
        self._session_open = False

    # -- teardown ------------------------------------------------------------------------------

    def _disconnect(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._fleet.close()
        self._writers, self._targets, self._groups = {}, {}, None
        self._session_open = self._snapshot_taken = self._checked = False

    def close(self) -> None:
        """Release connections, writer threads and the transport (and its registrations)."""
        self._disconnect()
        self._buffers = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def __enter__(self) -> WeightSyncSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _pairs(named_tensors: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    if isinstance(named_tensors, torch.Tensor):
        raise ConfigError("update() takes (hf_name, tensor) pairs or a name -> tensor mapping")
    return named_tensors


@contextmanager
def _timed(stages: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - started


def _next_version_after(version: str, current: int) -> int:
    """Auto-versions continue past a numeric version, and never go backwards."""
    try:
        return max(current, int(version) + 1)
    except ValueError:
        return current  # a named version ("step-9") uses up no number


__all__ = ["WeightSyncSession"]
