"""``WeightSyncSession``: connect to engines once, then push every training step's weights.

The session only sequences. Connecting and each engine's update state
(``engines``), the rank assignment and the byte plan (``plan``), the replicas
(``replica``), the trainer's tensors (``source``) and staging and writing
(``transfer``) live elsewhere.

One update, as sglang expects it, each step acting only on engines that need it
(``engines.update_session`` keeps every engine's state from its own answers)::

    open:   pause_generation -> flush_cache -> begin_weight_update
            -> update_weight_version("p2pweights-updating:<v>")
    write:  every engine rank's bytes
    close:  end_weight_update
    check:  weights_checker compare (first update, when asked)
    finish: update_weight_version("<v>") -> continue_generation

With several sending trainer ranks, trainer rank 0 drives the engines' update
session; after each step all ranks ``agree`` on whether every one of them succeeded,
so the others write only inside the open session and all ranks fail together.

Pipeline stages (``SyncConfig.num_pipeline_stages``) are sender groups holding
disjoint parameters: each stage splits the engine ranks among its own ranks and
writes only its own parameters, to every engine rank; stage 0's rank 0 drives the
engines, and ``agree`` spans the ranks of every stage. The first update gathers what
every rank sends (``gather``), so each checks that the stages together feed every
parameter of its targets, no tensor comes from two stages and no parameter group
needs tensors of two stages; nothing else crosses stages.

After a failed update the engines stay paused: the next ``update`` rewrites every
weight and resumes them, ``abort()`` gives up (ends open sessions, resumes the
engines whose weights are whole), and ``close()`` does the same as ``abort()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch

from p2pweights import errors
from p2pweights.config import SyncConfig
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectedEngine, ConnectOptions, Fleet, concurrently
from p2pweights.engines.published import RankPublication
from p2pweights.engines.update_session import AbortReport, EngineUpdate
from p2pweights.errors import ConfigError, LayoutMismatchError, P2PWeightsError, TransferError
from p2pweights.plan.assignment import Target, assign_targets
from p2pweights.plan.byte_plan import BytePlan, GroupPlan, aligned, build_byte_plan
from p2pweights.progress import progress
from p2pweights.replica.registry import ReplicaHandle, config_path, replica_for
from p2pweights.report import UpdateReport
from p2pweights.source.checkpoint_format import unify
from p2pweights.source.completeness import check_whole_parameters
from p2pweights.source.expected import (
    ExpectedCheckpoint,
    check_first_update,
    engine_dtype,
    expected_checkpoint,
)
from p2pweights.source.inputs import InputSpec, ParamGroup, describe_inputs, described_inputs
from p2pweights.source.stream import UpdateSource
from p2pweights.transfer.executor import RunResult, TransferExecutor
from p2pweights.transfer.transports import create_transport

logger = logging.getLogger(__name__)
T = TypeVar("T")

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]

_ERRORS: dict[str, type[P2PWeightsError]] = {
    name: cls
    for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, P2PWeightsError)
}
"""p2pweights' error classes by name: a failed step raises the failing rank's class everywhere."""


class WeightSyncSession:
    """Pushes a trainer's HF-named tensors into connected sglang engines, point to point."""

    def __init__(
        self,
        config: SyncConfig | None = None,
        *,
        agree: Callable[[bool], bool] | None = None,
        gather: Callable[[object], list[object]] | None = None,
        staging_device: torch.device | str | None = None,
    ):
        """``agree(ok)`` must return whether every sending trainer rank, of every pipeline
        stage, passed ``True`` (an all-reduce of the flags, e.g.
        ``p2pweights.adapters.torch_agree()``); it is required with more than one sending
        rank. ``gather(obj)`` must return every such rank's ``obj`` (picklable), in one
        order on every rank (an all-gather, e.g. ``p2pweights.adapters.torch_gather()``):
        required with pipeline stages, and, where given, a failed step raises on every
        rank the same error (the first failing rank's, naming it). ``staging_device``
        places the staging buffers ("cpu": pinned host memory; "cuda:N" where the
        transport reads GPU memory); by default the GPU of a ``CudaIpcConfig`` transport,
        else pinned host memory. ``from_torch_distributed`` fills all of this in.
        """
        self.config = config or SyncConfig()
        if self.config.num_senders > 1 and agree is None:
            raise ConfigError(
                "with several sending trainer ranks pass agree= (e.g. "
                "p2pweights.adapters.torch_agree()), or use "
                "WeightSyncSession.from_torch_distributed(config), so all trainer ranks write "
                "inside the session rank 0 opens and fail together"
            )
        if self.config.num_pipeline_stages > 1 and gather is None:
            raise ConfigError(
                "with num_pipeline_stages > 1 pass gather= (e.g. "
                "p2pweights.adapters.torch_gather()), or use "
                "WeightSyncSession.from_torch_distributed(config): the first update checks "
                "that the stages together send every parameter"
            )
        self._agree = agree or (lambda ok: ok)
        self._gather = gather
        self._staging_device = _staging_device(self.config, staging_device)
        self._executor: TransferExecutor | None = None
        self._fleet = Fleet([])
        self._replicas: dict[Hashable, ReplicaHandle] = {}
        self._targets: dict[Hashable, list[RankPublication]] = {}
        self._source: UpdateSource | None = None
        self._expected: dict[object, tuple[ExpectedCheckpoint, torch.dtype | None]] = {}
        self._plan: BytePlan | None = None
        self._plan_groups: dict[Hashable, list[tuple[frozenset[str], Sequence[str]]]] = {}
        self._next_version = 1
        self._checked = False
        self._orphans: dict[str, EngineUpdate] = {}
        """Engines of an earlier connect not connected now, until abort() releases them."""
        self._last_run: RunResult | None = None
        self._reads_seen: tuple[int, ...] | None = None
        """The recordings' change counts the fp8 regions were learned from."""
        self._running = threading.Lock()
        """Held while update() runs; abort() from another thread waits for it."""
        self._updating_thread: int | None = None
        self._cancel = threading.Event()
        """Set by abort() while an update runs: it stops before its writes or at its next group."""

    @classmethod
    def from_torch_distributed(
        cls,
        config: SyncConfig | None = None,
        *,
        group: Any = None,
        staging_device: torch.device | str | None = None,
    ) -> WeightSyncSession:
        """A session for every rank of a ``torch.distributed`` ``group`` (default: all).

        Every rank of ``group`` sends, and each must call this (it runs one all-gather).
        ``config.pipeline_stage`` / ``num_pipeline_stages`` say which stage this rank
        holds (default: one stage, all ranks holding the same weights, e.g. FSDP2);
        ``trainer_rank`` and ``num_trainer_ranks`` are filled in (this rank's place
        among its stage's ranks, in group order), replacing any given, as are ``agree``
        and ``gather`` over ``group`` (gloo or NCCL).
        """
        from p2pweights.adapters.torch_distributed import (
            torch_agree,
            torch_gather,
            torch_stage_ranks,
        )

        config = config or SyncConfig()
        rank, size = torch_stage_ranks(config.pipeline_stage, config.num_pipeline_stages, group)
        fields = {**config.model_dump(), "trainer_rank": rank, "num_trainer_ranks": size}
        return cls(
            SyncConfig(**fields),
            agree=torch_agree(group),
            gather=torch_gather(group),
            staging_device=staging_device,
        )

    @property
    def _leader(self) -> bool:
        return self.config.leads

    @property
    def _rank_name(self) -> str:
        config = self.config
        if config.num_pipeline_stages == 1:
            return f"trainer rank {config.trainer_rank}"
        return f"pipeline stage {config.pipeline_stage} trainer rank {config.trainer_rank}"

    # -- connect -------------------------------------------------------------------------------

    def connect(self, engines: Sequence[str | EngineEndpoint]) -> None:
        """Read every engine's layout and published weights; prepare this rank's targets.

        Refuses, before any byte moves, engines published for another transport,
        engines on another sglang release (unless ``allow_sglang_mismatch``), layouts
        that cannot be written and engines whose published parameter sizes differ
        from the replica's. Engines are ordered by URL, so every trainer rank plans
        the same way whatever order it lists them in. An engine a previous session
        left mid-update is adopted: the next update rewrites it whole. A failed
        connect leaves the session unconnected.

        Called again with another engine list (engines added, removed, restarted on new
        addresses), it reads every engine afresh and plans the next update anew; the
        replicas (one per layout, for the process) and the registered staging buffers
        are kept, and an engine rank no longer listed, or listed with other addresses,
        loses its writer and its transport connection: nothing is written to a stale
        registration.
        """
        if not engines:
            raise ConfigError("connect() needs at least one engine URL")
        endpoints = sorted((EngineEndpoint.of(e) for e in engines), key=lambda e: e.url)
        if len({e.url for e in endpoints}) != len(endpoints):
            raise ConfigError("each engine may be listed once")
        # engines of the last connection: their update state (paused by us? torn?) is kept
        # for a reconnect to the same URL, and abort()/close() still reach the others
        self._orphans.update({e.url: e.update for e in self._fleet.engines})
        self._fleet.engines = []
        self._disconnect()
        config = self.config
        try:
            fleet = Fleet.connect(
                endpoints,
                ConnectOptions(
                    config.transport.kind,
                    config.http_timeout_s,
                    config.control_timeout_s,
                    config.api_key,
                    config.allow_sglang_mismatch,
                ),
            )
        except BaseException:
            if self._executor is not None:
                self._executor.disconnect()
            raise
        try:
            if self._executor is None:
                transport = create_transport(config.transport)
                self._executor = TransferExecutor(
                    transport, self._staging_device, config.transfer_timeout_s
                )
            targets = self._assign(fleet)
            pubs = [pub for key_pubs in targets.values() for pub in key_pubs]
            self._executor.connect(pubs)  # drops what is no longer a target
            if targets:  # an idle trainer rank stages nothing
                # no group is smaller than its largest parameter: the staging size known now
                largest = 0
                with progress("p2pweights connect: building replicas", total=len(targets)) as step:
                    for key in targets:  # building each replica (once per layout) here
                        handle = self._replicas[key]
                        largest = max(
                            largest, *(aligned(handle.param_bytes(n)) for n in handle.layouts)
                        )
                        step(1)
                self._executor.reserve(max(config.buffer_bytes, largest))
        except BaseException:
            fleet.close_clients()
            if self._executor is not None:
                self._executor.disconnect()
            raise
        for engine in fleet.engines:
            before = self._orphans.pop(engine.url, None)
            if before is not None:
                engine.update.take_over(before)
                before.client.close()
        self._fleet, self._targets = fleet, targets
        # what each engine's checkpoint holds, for checking the first update (cached per config)
        self._expected = {
            (path, engine.server_info.get("dtype")): (
                expected_checkpoint(path.parent),
                engine_dtype(engine.server_info.get("dtype")),
            )
            for engine in fleet.engines
            for path in [config_path(engine.server_info, engine.endpoint.model_path)]
        }
        self._next_version = max(self._next_version, fleet.next_numeric_version())
        logger.info(
            "connected to %d engine(s); trainer rank %d writes %d engine rank(s), %d replica(s)",
            len(fleet.engines),
            config.trainer_rank,
            sum(len(pubs) for pubs in targets.values()),
            len(targets),
        )

    def _assign(self, fleet: Fleet) -> dict[Hashable, list[RankPublication]]:
        """This trainer rank's targets by replica, each checked against its replica.

        Targets are balanced by the bytes each engine rank published (its draft's
        included): what every trainer rank reads alike, without building a replica for
        ranks it does not write.
        """
        assignment = assign_targets(
            self.config.num_trainer_ranks,
            [
                Target(e.index, rank, self._replica(e, rank).key, e.published_bytes(rank))
                for e in fleet.engines
                for rank in range(e.num_ranks)
            ],
        )
        targets: dict[Hashable, list[RankPublication]] = {}
        for target in assignment[self.config.trainer_rank]:
            engine = fleet.engines[target.engine_index]
            # the sender of an engine rank also writes its speculative draft, if any
            pubs = [engine.publications[target.engine_rank]]
            if engine.draft_publications:
                pubs.append(engine.draft_publications[target.engine_rank])
            for pub in pubs:
                handle = self._replica(engine, target.engine_rank, pub.role)
                handle.check_published(pub)
                targets.setdefault(handle.key, []).append(pub)
        return targets

    def _replica(self, engine: ConnectedEngine, rank: int, role: str = "target") -> ReplicaHandle:
        handle = replica_for(engine.server_info, rank, engine.endpoint.model_path, role)
        return self._replicas.setdefault(handle.key, handle)

    def update(self, named_tensors: NamedTensors, *, version: str | None = None) -> UpdateReport:
        """Write ``(hf_name, tensor)`` pairs (checkpoint names) into every connected engine.

        Returns once every engine runs the new weights; raises if any write failed,
        was refused or is still running after ``transfer_timeout_s``, or an engine
        did not answer an update-session call within ``control_timeout_s``. A
        Mapping or a sequence is checked whole before any byte is written (the first
        update also against the engine's checkpoint); an iterator is checked tensor
        by tensor. Tensors must stay unchanged until ``update`` returns: bytes are
        loaded from them when their staging buffer is flushed.

        After a failed update the engines stay paused (their weight version says
        ``p2pweights-updating:<version>``); the next ``update`` rewrites every weight
        and resumes them, or ``abort()`` gives up. ``abort()`` from another thread
        cancels a running update: it stops before its writes or at its next
        parameter group and raises ``TransferError``, and then ``abort()`` does its work
        (an update past its writes completes first).
        """
        if not self._running.acquire(blocking=False):
            raise ConfigError("update() is already running in another thread of this session")
        self._updating_thread = threading.get_ident()
        try:
            return self._update(named_tensors, version)
        finally:
            self._updating_thread = None
            self._cancel.clear()
            self._running.release()

    def _update(self, named_tensors: NamedTensors, version: str | None) -> UpdateReport:
        if not self._fleet.engines or self._executor is None:
            raise ConfigError("call connect(engines) before update()")
        started = time.perf_counter()
        stages: dict[str, float] = {}
        tensors = _pairs(named_tensors)
        whole = not isinstance(tensors, Iterator)
        first = self._plan is None
        described = described_inputs(named_tensors) if first and not whole else None
        if (first and described is None) or whole:
            tensors = list(tensors)  # a first update must be known whole before it is planned
            whole = True  # checked whole in prepare, not again as it streams
        given = tensors if isinstance(tensors, list) else None
        # every rank takes this step (an iterator is checked as it streams): ranks must
        # run the same collectives whatever each one was given
        with _timed(stages, "probe" if first else "check_inputs"):
            try:
                self._step("prepare", lambda: self._prepare(given, described))
            except BaseException:
                if first:  # every rank probes again next time: they must gather alike
                    self._source = self._plan = None
                raise
        version = version or str(self._next_version)
        with _timed(stages, "control_plane"):
            self._step("open", lambda: self._open(version))
        try:
            result = self._step("write", lambda: self._write(tensors, whole, stages))
        except BaseException:
            self._forget_regions()  # a loader may have to run again: quantize whole
            raise
        try:
            self._learn_regions()
        except Exception:  # only an optimisation: the writes landed, the update goes on
            logger.warning("p2pweights: fp8 regions not learned; quantizing whole", exc_info=True)
            self._forget_regions()
        if self._leader:
            self._fleet.writes_landed(lambda url: True)  # every rank's writes landed
        with _timed(stages, "control_plane"):
            self._step("close", self._close)
        if self.config.check_weight_update_equal and not self._checked:
            with _timed(stages, "verify"):
                self._step("check", self._check)
            # once, after it passed on every engine: later updates send other weights than
            # the snapshot's; a failed check is run again by the retry
            self._checked = True
        with _timed(stages, "control_plane"):
            self._step("finish", lambda: self._finish(version))
        self._next_version = _next_version_after(version, self._next_version)
        stages["load"], stages["wait"] = result.load_s, result.wait_s
        report = UpdateReport(
            version=version,
            bytes_by_target=dict(result.bytes_by_target),
            stage_seconds=stages,
            seconds=time.perf_counter() - started,
        )
        logger.info("p2pweights update %s", report.summary())
        return report

    def _step(self, name: str, action: Callable[[], T]) -> T:
        """Run ``action``; every trainer rank learns whether all of them succeeded."""
        error: Exception | None = None
        try:
            result = action()
        except Exception as exc:  # an interrupt propagates at once: no rank waits for it
            error = exc
        if not self._agree(error is None):
            if name == "write" and self._leader:
                self._fleet.writes_landed(self._landed_alone)
            failure = self._failure(name, error)
            if failure is error:
                raise failure
            raise failure from error
        return result

    def _failure(self, name: str, error: Exception | None) -> Exception:
        """What this rank raises for a failed step: with ``gather``, the first failing
        rank's error on every rank (same class where it is p2pweights', same message)."""
        if self._gather is None:
            if error is not None:
                return error
            return TransferError(
                f"{self._rank_name}: another trainer rank failed the '{name}' step of this "
                f"update (its error names the engine)"
            )
        mine = None if error is None else (self._rank_name, type(error).__name__, str(error))
        failures = [cast(tuple[str, str, str], f) for f in self._gather(mine) if f is not None]
        assert failures, "agree() said a rank failed, but none reported an error"
        who, kind, message = failures[0]
        others = f" ({len(failures) - 1} other rank(s) failed too)" if len(failures) > 1 else ""
        cls = _ERRORS.get(kind, P2PWeightsError)
        prefix = "" if cls.__name__ == kind else f"{kind}: "
        return cls(f"{who} failed the '{name}' step of this update{others}: {prefix}{message}")

    def _prepare(
        self,
        tensors: list[tuple[str, torch.Tensor]] | None,
        described: dict[str, InputSpec] | None = None,
    ) -> None:
        """Check the whole input (None: an iterator, checked as it streams); on the first
        update also probe the loaders and plan, from the input or from what a described
        iterator says it will yield."""
        if self._source is not None and self._plan is not None:
            if tensors is not None:
                self._source.check_whole(tensors)
            return
        assert tensors is not None or described is not None, "a first update is known whole"
        own: dict[str, InputSpec] | None = None
        error: Exception | None = None
        try:
            own = describe_inputs(tensors) if tensors is not None else dict(described or {})
            self._check_against_checkpoints(own)
        except Exception as exc:  # raised after the gather: every rank must take part
            error = exc
        specs = self._stage_inputs(None if error else own)
        if error is not None:
            raise error
        if own is None or specs is None:
            return  # another rank failed before the gather; agree() fails the step
        keys = sorted(self._targets, key=str)
        check_whole_parameters(
            specs,
            [expected for expected, _ in self._expected.values() if expected is not None],
            (self._replicas[key].trainer_feeds for key in keys),  # probed only if needed
        )
        with progress("p2pweights: probing sglang's loaders", total=2 * len(keys)) as advance:
            formats = {}
            for key in keys:
                formats[key] = self._replicas[key].checkpoint_format(specs)
                advance(1)
            formats = unify(formats)
            groups = {}
            for key in keys:
                groups[key] = _own_groups(
                    self._replicas[key].groups(formats[key].engine_specs(specs)),
                    formats[key].engine_specs(own),
                )
                advance(1)
        self._plan_groups = {
            key: [(g.hf_names, g.param_names) for g in groups[key]] for key in keys
        }
        plan = self._build_plan()
        source = UpdateSource(
            own,
            {key: [g.hf_names for g in groups[key]] for key in keys},
            formats,
            finite=self.config.check_finite,
        )
        if tensors is not None:
            source.check_whole(tensors)
        assert self._executor is not None
        if self._targets:
            self._executor.reserve(plan.buffer_bytes)
        self._source, self._plan = source, plan
        self._reads_seen = None  # a new source learns its regions afresh

    def _build_plan(
        self, targets: Mapping[Hashable, Sequence[RankPublication]] | None = None
    ) -> BytePlan:
        """The byte plan of the probed groups into the targets' publications (by default
        the current targets)."""
        return build_byte_plan(
            self._plan_groups,
            {key: _ParamBytes(self._replicas[key]) for key in self._plan_groups},
            self._targets if targets is None else targets,
            self.config.buffer_bytes,
        )

    def _refresh_targets(self) -> None:
        """Re-read the live publications of this rank's targets, whose update sessions are
        open now; write where the engine's parameters live now.

        A live publisher (the p2pweights sglang plugin) publishes afresh when the engine
        replaced parameter storage (sglang's CPU AMX packing does after every load); the
        old addresses are then freed memory. A publication that moved is checked against
        its replica like a new one, reconnected and planned into.
        """
        assert self._executor is not None
        live = [
            (key, index, pub)
            for key, pubs in self._targets.items()
            for index, pub in enumerate(pubs)
            if pub.live
        ]
        if not live:
            return
        clients = {engine.url: engine.client for engine in self._fleet.engines}
        fresh = concurrently(
            lambda item: clients[item[2].engine_url].publication(item[2].engine_rank, item[2].role),
            live,
        )
        targets = {key: list(pubs) for key, pubs in self._targets.items()}
        moved = False
        for (key, index, old), new in zip(live, fresh, strict=True):
            if new == old:
                continue
            try:
                self._replicas[key].check_published(new)
            except LayoutMismatchError as exc:
                raise LayoutMismatchError(
                    f"{new.where} published its weights afresh (epoch {old.epoch} -> "
                    f"{new.epoch}: the engine replaced parameter storage), and they no longer "
                    f"fit its sglang layout, so p2pweights cannot write it: {exc}"
                ) from exc
            logger.info(
                "%s published its weights afresh (epoch %d -> %d); writing to the new addresses",
                new.where,
                old.epoch,
                new.epoch,
            )
            targets[key][index] = new
            moved = True
        if not moved:
            return
        # connected and planned first, then kept: a failure here leaves the old targets,
        # so the next update sees the publication as new again and retries this
        self._executor.connect([pub for pubs in targets.values() for pub in pubs])
        plan = self._build_plan(targets) if self._plan is not None else None
        self._targets, self._plan = targets, plan

    def _stage_inputs(self, own: dict[str, InputSpec] | None) -> dict[str, InputSpec] | None:
        """With pipeline stages: the inputs of every stage (one all-gather, first update
        only), checked for tensors sent by two stages; None if a rank (``own`` None here)
        failed before it."""
        if self.config.num_pipeline_stages == 1:
            return own
        assert self._gather is not None
        gathered = self._gather(None if own is None else (self.config.pipeline_stage, own))
        if any(entry is None for entry in gathered):
            return None
        return _union_of_stages(gathered)  # type: ignore[arg-type]

    def _check_against_checkpoints(self, specs: Mapping[str, InputSpec]) -> None:
        """The first update must match the checkpoint each engine's config describes."""
        for expected, dtype in self._expected.values():
            check_first_update(specs, expected, engine_dtype=dtype)

    def _open(self, version: str) -> None:
        if not self._leader:
            return
        # each engine snapshots and resets once (it records that), before the first check
        snapshot = self.config.check_weight_update_equal and not self._checked
        self._fleet.open(self.config.pause_mode, version, snapshot)

    def _write(
        self, tensors: Iterable[tuple[str, torch.Tensor]], checked: bool, stages: dict[str, float]
    ) -> RunResult:
        try:
            return self._write_all(tensors, checked, stages)
        except BaseException:
            if self.config.num_senders > 1 and isinstance(tensors, Iterator):
                # A stream may run collectives as it is read (FSDP2 gathers bucket by
                # bucket): every rank must read it to the end, or the others hang in them.
                for _ in tensors:
                    pass
            raise

    def _write_all(
        self, tensors: Iterable[tuple[str, torch.Tensor]], checked: bool, stages: dict[str, float]
    ) -> RunResult:
        assert self._executor is not None and self._source is not None and self._plan is not None
        self._last_run = None
        self._raise_if_cancelled("write")  # abort() came while preparing or opening
        with _timed(stages, "control_plane"):
            self._refresh_targets()  # before anything is written: the sessions are open now
        if self._leader:
            self._fleet.mark_written()
        if not self._targets:
            # an idle trainer rank writes nothing, but a stream must still be consumed whole
            for _ in self._source.ready(tensors, self._plan, checked=checked):
                pass
            return RunResult()
        plan, source = self._plan, self._source  # the refresh may have planned anew
        total = sum(plan.bytes_by_target.values())
        try:
            with progress("p2pweights update", total, unit="B", unit_scale=True) as advance:

                def ready() -> Iterator[tuple[GroupPlan, Sequence[tuple[str, torch.Tensor]]]]:
                    for group, inputs in source.ready(tensors, plan, checked=checked):
                        self._raise_if_cancelled("write")
                        yield group, inputs
                        advance(group.block_bytes * len(group.targets))

                result = self._executor.run(
                    plan,
                    ready(),
                    lambda key, inputs, views: self._replicas[key].load_into(inputs, views),
                )
        finally:
            if self._source.convert_s:
                stages["convert"] = self._source.convert_s
        self._last_run = result
        result.raise_if_failed()
        return result

    def _raise_if_cancelled(self, where: str) -> None:
        if self._cancel.is_set():
            raise TransferError(
                f"{self._rank_name}: the update was cancelled by abort() from another thread "
                f"(at its '{where}' step)"
            )

    def _learn_regions(self) -> None:
        """fp8 engines: from the next update on, quantize only the blocks this rank's
        loaders read, as their checked recordings say (``UpdateSource.use_regions``)."""
        if self._source is None:
            return
        keys = self._source.quantizing_keys()
        seen = tuple(self._replicas[key].replays_changed for key in keys)
        if not keys or seen == self._reads_seen:
            return
        self._reads_seen = seen
        self._source.use_regions({key: self._replicas[key].input_reads() for key in keys})

    def _forget_regions(self) -> None:
        self._reads_seen = None
        if self._source is not None:
            self._source.use_regions({})

    def _landed_alone(self, url: str) -> bool:
        """After a failed write step: whether ``url`` surely got all its bytes. Only a lone
        trainer rank knows (with several, another rank may have failed it)."""
        run = self._last_run
        return self.config.num_senders == 1 and run is not None and run.complete(url)

    def _close(self) -> None:
        if self._leader:
            self._fleet.close()

    def _check(self) -> None:
        if self._leader:
            self._fleet.compare()

    def _finish(self, version: str) -> None:
        if self._leader:
            self._fleet.finish(version)

    # -- giving up and teardown ----------------------------------------------------------------

    def abort(self, *, resume_incomplete: bool = False) -> AbortReport:
        """Give up on an update: end open update sessions and resume the engines this
        session paused whose weights are whole.

        An engine whose writes did not all land stays paused, its weight version
        saying ``p2pweights-updating:<version>``, unless ``resume_incomplete`` (then it
        serves torn weights, and still shows that version). Returns what happened to
        each engine, including those that could not be reached; it does not raise.
        Only trainer rank 0 drives the engines; on other ranks this returns an empty
        report. Called from another thread while ``update()`` runs, it cancels that
        update (which raises ``TransferError`` before its writes or at its next parameter
        group) and waits for it to stop (writes in flight are bounded by ``transfer_timeout_s``,
        engine calls by their time limits) before giving up as above.
        """
        with self._stopped_update():
            return self._abort(resume_incomplete)

    @contextmanager
    def _stopped_update(self) -> Iterator[None]:
        """Inside: no update runs (one running in another thread is cancelled and waited for)."""
        if self._running.locked():
            self._cancel.set()
            if self._updating_thread == threading.get_ident():
                raise ConfigError(
                    "abort() or close() was called inside update() on its own thread (from "
                    "a signal handler?): the update is cancelled and raises TransferError; "
                    "call abort() once it returned"
                )
        with self._running:
            self._cancel.clear()
            yield

    def _abort(self, resume_incomplete: bool) -> AbortReport:
        report = AbortReport()
        if self._executor is not None:
            try:
                self._executor.settle()  # a failed update's writes must not land after this
            except TransferError as exc:
                logger.warning("abort: %s", exc)
        if self._leader and self._fleet.engines:
            report = self._fleet.abort(resume_incomplete)
        if self._leader:
            for url, orphan in self._orphans.items():  # engines an earlier connect reached
                try:
                    report.outcomes[url] = orphan.abort(resume_incomplete)
                except Exception as exc:  # abort reports, it does not raise
                    report.outcomes[url] = f"unreachable: {exc}"
                orphan.client.close()
            self._orphans = {}
        if not report.ok:
            logger.warning("p2pweights abort: %s", report)
        return report

    def _disconnect(self) -> None:
        """Forget the engines and the plan. The executor keeps its buffers and, until the
        next ``connect`` replaces them (or ``close`` drops them), its connections."""
        self._fleet.close_clients()
        self._targets, self._plan, self._source = {}, None, None
        # the weight check stays done: it compares the session's first update with the
        # engines' start weights; a reconnect's next update sends trained weights

    def close(self) -> None:
        """``abort()``, then release connections, writer threads and the transport (an
        update running in another thread is cancelled and waited for first)."""
        with self._stopped_update():
            try:
                self._abort(resume_incomplete=False)
            except Exception as exc:  # closing must not hide the error that led here
                logger.warning("p2pweights close: abort failed: %r", exc)
            self._disconnect()
            if self._executor is not None:
                transport = self._executor.transport
                self._executor.close()
                transport.close()
                self._executor = None

    def __enter__(self) -> WeightSyncSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _ParamBytes(Mapping[str, int]):
    """A replica's parameter sizes, read lazily (the plan asks for the ones it stages)."""

    def __init__(self, handle: ReplicaHandle):
        self._handle = handle

    def __getitem__(self, name: str) -> int:
        return self._handle.param_bytes(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._handle.layouts)

    def __len__(self) -> int:
        return len(self._handle.layouts)


def _union_of_stages(
    gathered: Sequence[tuple[int, Mapping[str, InputSpec]]],
) -> dict[str, InputSpec]:
    """Every stage's inputs as one; a tensor may come from one stage only, and the ranks
    of one stage must send the same tensors."""
    by_stage: dict[int, Mapping[str, InputSpec]] = {}
    for stage, specs in gathered:
        if by_stage.setdefault(stage, specs) != specs:
            raise ConfigError(
                f"the trainer ranks of pipeline stage {stage} sent different HF tensors; the "
                f"ranks of one stage must send the same (gathered) tensors"
            )
    union: dict[str, InputSpec] = {}
    owner: dict[str, int] = {}
    for stage, specs in sorted(by_stage.items()):
        for name, spec in specs.items():
            if name in owner:
                raise ConfigError(
                    f"HF tensor {name!r} was sent by pipeline stages {owner[name]} and {stage}; "
                    f"each tensor must come from one stage (drop tied copies on all but one)"
                )
            owner[name], union[name] = stage, spec
    return union


def _own_groups(groups: Sequence[ParamGroup], own: Mapping[str, InputSpec]) -> list[ParamGroup]:
    """The groups this rank's own tensors feed whole (with one stage: every group)."""
    mine = []
    for group in groups:
        sent = group.hf_names & own.keys()
        if sent == group.hf_names:
            mine.append(group)
        elif sent:
            raise ConfigError(
                f"parameters {list(group.param_names)[:4]} are loaded from HF tensors "
                f"{sorted(group.hf_names)[:6]} together, but this pipeline stage sends only "
                f"{sorted(sent)[:6]}; one stage must send all of them"
            )
    return mine


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


def _staging_device(config: SyncConfig, given: torch.device | str | None) -> torch.device:
    """Where the staging buffers live: as given, else on the GPU a CUDA IPC transport
    copies from (device copies over NVLink), else in pinned host memory."""
    if given is not None:
        device = torch.device(given)
        transport_gpu = getattr(config.transport, "device", None)
        if (
            device.type == "cuda"
            and None not in (device.index, transport_gpu)
            and (device.index != transport_gpu)
        ):
            logger.warning(
                "staging on %s while CudaIpcConfig copies from cuda:%d: every copy then "
                "crosses GPUs twice; stage on the transport's GPU",
                device,
                transport_gpu,
            )
        return device
    if config.transport.kind == "cuda_ipc" and torch.cuda.is_available():
        gpu = config.transport.device
        return torch.device("cuda", torch.cuda.current_device() if gpu is None else gpu)
    return torch.device("cpu")
