"""``WeightSyncSession``: connect to engines once, then push every training step's weights.

The session only sequences. Connecting (``engines.fleet``), planning
(``plan.assignment``), the replicas (``replica``), grouping inputs
(``plan.inputs``), staging and writing (``transfer.pipeline``) live elsewhere.

One update, as sglang expects it::

    pause_generation -> flush_cache -> begin_weight_update -> writes
    -> update_weight_version -> end_weight_update -> continue_generation

With several sending trainer ranks, trainer rank 0 drives the engines' update
session and the ``barrier`` the caller passes keeps the others' writes inside it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from p2pweights.config import SyncConfig
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectedEngine, connect_engine
from p2pweights.engines.published import RankPublication
from p2pweights.errors import ConfigError, EngineError, P2PWeightsError
from p2pweights.plan.assignment import Target, assign_targets
from p2pweights.plan.inputs import (
    GroupCollector,
    InputSpec,
    ParamGroup,
    check_input,
    describe_inputs,
)
from p2pweights.replica.registry import ReplicaHandle, replica_for
from p2pweights.report import UpdateReport
from p2pweights.transfer.buffers import StagingBuffers, aligned
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
        barrier: Callable[[], None] | None = None,
        staging_device: torch.device | str = "cpu",
    ):
        self.config = config or SyncConfig()
        if self.config.num_trainer_ranks > 1 and barrier is None:
            raise ConfigError(
                "with num_trainer_ranks > 1 pass barrier= (e.g. torch.distributed.barrier) so "
                "every trainer rank writes inside the update session trainer rank 0 opens"
            )
        self._barrier = barrier or (lambda: None)
        self._staging_device = torch.device(staging_device)
        self._transport: Transport | None = None
        self._engines: list[ConnectedEngine] = []
        self._replicas: dict[Hashable, ReplicaHandle] = {}
        self._targets: dict[Hashable, list[RankPublication]] = {}
        self._writers: dict[str, EngineWriter] = {}
        self._buffers: StagingBuffers | None = None
        self._groups: dict[Hashable, list[ParamGroup]] | None = None
        self._inputs: dict[str, InputSpec] = {}
        self._next_version = 1
        self._checked = False

    # -- connect -------------------------------------------------------------------------------

    def connect(self, engines: Sequence[str | EngineEndpoint]) -> None:
        """Read every engine's layout and published weights; prepare this rank's targets.

        Refuses, before any byte moves, engines published for another transport and
        engines whose published parameter sizes differ from the replica's.
        """
        if not engines:
            raise ConfigError("connect() needs at least one engine URL")
        endpoints = [EngineEndpoint.of(e) for e in engines]
        if len({e.url for e in endpoints}) != len(endpoints):
            raise ConfigError("each engine may be listed once")
        self._close_engines()
        self._groups = None  # re-derived from the (process-cached) probes at the next update
        kind = self.config.transport.kind
        self._engines = self._parallel(
            lambda pair: connect_engine(
                pair[0], pair[1], kind, self.config.http_timeout_s, self.config.api_key
            ),
            list(enumerate(endpoints)),
        )
        if self._transport is None:
            self._transport = create_transport(self.config.transport)
        mine = self._my_targets()
        self._targets = {}
        for engine, rank in mine:
            handle = self._replica(engine, rank)
            pub = engine.publications[rank]
            handle.check_published(pub)
            self._targets.setdefault(handle.key, []).append(pub)
            self._transport.connect(pub)
        self._writers = {
            e.url: EngineWriter(e.url, self._transport, self.config.transfer_timeout_s)
            for e in self._engines
            if any(pub.engine_url == e.url for pubs in self._targets.values() for pub in pubs)
        }
        self._next_version = max(self._next_version, _next_numeric_version(self._engines))
        logger.info(
            "connected to %d engine(s); trainer rank %d writes %d engine rank(s), %d replica(s)",
            len(self._engines),
            self.config.trainer_rank,
            len(mine),
            len(self._targets),
        )

    def _my_targets(self) -> list[tuple[ConnectedEngine, int]]:
        targets = [
            Target(e.index, rank, layout_key=self._replica(e, rank).key)
            for e in self._engines
            for rank in range(e.num_ranks)
        ]
        plan = assign_targets(self.config.num_trainer_ranks, targets)
        return [
            (self._engines[t.engine_index], t.engine_rank) for t in plan[self.config.trainer_rank]
        ]

    def _replica(self, engine: ConnectedEngine, rank: int) -> ReplicaHandle:
        handle = replica_for(engine.server_info, rank, engine.endpoint.model_path)
        self._replicas.setdefault(handle.key, handle)
        return self._replicas[handle.key]

    # -- update --------------------------------------------------------------------------------

    def update(self, named_tensors: NamedTensors, *, version: str | None = None) -> UpdateReport:
        """Write ``(hf_name, tensor)`` pairs (checkpoint names) into every connected engine.

        Returns once every engine runs the new weights; raises if any write failed,
        was refused or is still running after ``transfer_timeout_s``. A Mapping or a
        sequence is checked whole before any byte is written; an iterator is checked
        tensor by tensor (the first update always reads it whole to probe the loaders).
        """
        if not self._engines:
            raise ConfigError("call connect(engines) before update()")
        started = time.perf_counter()
        stages: dict[str, float] = {}
        tensors = _pairs(named_tensors)
        if self._groups is None or not isinstance(tensors, Iterator):
            tensors = list(tensors)
            with _timed(stages, "probe" if self._groups is None else "check_inputs"):
                self._prepare(tensors)
        if self._buffers is None:
            self._allocate_buffers()
        version = version or str(self._next_version)
        leader = self.config.trainer_rank == 0
        with _timed(stages, "control_plane"):
            if leader:
                self._open_update()
            self._barrier()
        stats = self._write_all(tensors)
        with _timed(stages, "control_plane"):
            self._barrier()
            if leader:
                self._close_update(version)
        if leader and self.config.check_weight_update_equal and not self._checked:
            with _timed(stages, "verify"):
                self._each_engine(lambda e: e.client.weights_checker("compare"))
                self._checked = True
        with _timed(stages, "control_plane"):
            if leader:
                self._each_engine(lambda e: e.client.continue_generation())
        self._next_version = _numeric_successor(version, self._next_version)
        stages["load"], stages["wait"] = stats.load_s, stats.wait_s
        report = UpdateReport(
            version=version,
            bytes_by_target=dict(stats.bytes_by_target),
            stage_seconds=stages,
            seconds=time.perf_counter() - started,
        )
        logger.info("p2pweights update %s", report.summary())
        return report

    def _prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Check the whole input; on the first update also probe the loaders."""
        specs = describe_inputs(tensors)
        if self._groups is None:
            self._groups = {
                key: handle.groups(specs)
                for key, handle in self._replicas.items()
                if key in self._targets
            }
            self._inputs = specs
        for name, tensor in tensors:
            check_input(name, tensor, self._inputs)
        missing = sorted(set(self._inputs) - set(specs))
        if missing:
            raise ConfigError(
                f"this update lacks {len(missing)} HF tensor(s) the first update sent: "
                f"{', '.join(missing[:8])}"
            )

    def _allocate_buffers(self) -> None:
        assert self._groups is not None and self._transport is not None
        largest = max(
            (
                sum(aligned(self._replicas[key].param_bytes(p)) for p in group.param_names)
                for key, groups in self._groups.items()
                for group in groups
            ),
            default=0,
        )
        size = max(self.config.buffer_bytes, largest)
        self._buffers = StagingBuffers(size, self._staging_device, self._transport.register)

    def _write_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> PipelineStats:
        assert self._groups is not None and self._buffers is not None
        pipeline = UpdatePipeline(
            self._buffers,
            self._writers,
            self.config.transfer_timeout_s,
            lambda key, inputs, views: self._replicas[key].load_into(inputs, views),
        )
        collector = GroupCollector(self._groups)
        try:
            for name, tensor in tensors:
                check_input(name, tensor, self._inputs)
                for key, group, inputs in collector.add(name, tensor):
                    handle = self._replicas[key]
                    sizes = {p: handle.param_bytes(p) for p in group.param_names}
                    pipeline.stage(key, sizes, inputs, self._targets[key])
            collector.raise_if_incomplete()
            return pipeline.finish()
        except BaseException:
            # Writes may still read the buffers: never refill them; take fresh ones next time.
            self._buffers = None
            raise

    def _open_update(self) -> None:
        mode = self.config.pause_mode
        self._each_engine(lambda e: e.client.pause_generation(mode))
        if self.config.check_weight_update_equal and not self._checked:
            self._each_engine(lambda e: e.client.weights_checker("snapshot"))
            self._each_engine(lambda e: e.client.weights_checker("reset_tensors"))
        if mode != "in_place":
            self._each_engine(lambda e: e.client.flush_cache())
        self._each_engine(lambda e: e.client.begin_weight_update("all"))

    def _close_update(self, version: str) -> None:
        self._each_engine(lambda e: e.client.update_weight_version(version))
        self._each_engine(lambda e: e.client.end_weight_update())

    # -- helpers -------------------------------------------------------------------------------

    def _each_engine(self, call: Callable[[ConnectedEngine], object]) -> None:
        self._parallel(call, self._engines)

    def _parallel(self, call: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """Run ``call`` on every item concurrently; raise the first error after all finished."""
        if len(items) <= 1:
            return [call(item) for item in items]
        with ThreadPoolExecutor(min(len(items), 16)) as pool:
            futures = [pool.submit(call, item) for item in items]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]  # type: ignore[misc]
        return [f.result() for f in futures]

    def _close_engines(self) -> None:
        for writer in self._writers.values():
            writer.close()
        for engine in self._engines:
            engine.client.close()
        self._writers, self._engines = {}, []

    def close(self) -> None:
        """Release connections, writer threads and the transport (and its registrations)."""
        self._close_engines()
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


def _next_numeric_version(engines: Sequence[ConnectedEngine]) -> int:
    """One past the largest numeric weight version the engines report (1 if none is numeric)."""
    versions = []
    for engine in engines:
        try:
            versions.append(int(engine.client.weight_version()))
        except (ValueError, EngineError):
            continue
    return max(versions, default=0) + 1


def _numeric_successor(version: str, current: int) -> int:
    try:
        return int(version) + 1
    except ValueError:
        return current + 1


__all__ = ["P2PWeightsError", "WeightSyncSession"]
