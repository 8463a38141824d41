"""``WeightSyncSession``: connect to engines once, then push every training step's weights.

The session only sequences. Connecting and each engine's update state
(``engines``), the rank assignment and the byte plan (``plan``), the replicas
(``replica``), the trainer's tensors (``source``) and staging and writing
(``transfer``) live elsewhere.

One update, as sglang expects it, each step acting only on engines that need it
(``engines.update_session`` keeps every engine's state from its own answers)::

    stage:  the inputs read, checked, converted; the first staging buffer loaded
    open:   pause_generation -> update_weight_version("p2pweights-updating:<v>") and
            flush_cache at once -> begin_weight_update
    write:  every engine rank's bytes
    close:  end_weight_update
    verify: each rank's digests of its staged writes against the engine ranks' own
            (``SyncConfig.verify_writes``; ``p2pweights.integrity``)
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

One call runs at a time (``one_call``): ``update()`` and ``connect()`` while another
call runs, in any thread, raise ``SessionBusyError``; ``abort()`` and ``close()`` cancel a
running update and wait for any running call. An input written through torch after the
update received it fails the update with ``InputChangedError`` (``source.receipts``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from p2pweights import logs
from p2pweights.collective import Collective
from p2pweights.config import SyncConfig
from p2pweights.engines.calls import ControlCalls
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectedEngine, ConnectOptions, Fleet
from p2pweights.engines.update_session import AbortReport, EngineUpdate, updating_version
from p2pweights.errors import ConfigError, TransferError
from p2pweights.integrity.check import Mismatch, WriteCheck
from p2pweights.one_call import OneCall
from p2pweights.plan.byte_plan import BytePlan
from p2pweights.plan.prepare import (
    Prepared,
    build_plan,
    check_against_checkpoints,
    check_one_model,
    engine_checkpoints,
    prepare,
    staging_bytes,
)
from p2pweights.plan.targets import Targets, assign, moved
from p2pweights.progress import progress
from p2pweights.replica.registry import ReplicaHandle, replica_for
from p2pweights.report import DeltaReport, UpdateReport, Verification
from p2pweights.source.expected import ExpectedCheckpoint
from p2pweights.source.inputs import InputSpec, describe_inputs, described_inputs
from p2pweights.source.receipts import Receipts, checked_loaders
from p2pweights.transfer.executor import RunHooks, RunResult, TransferExecutor
from p2pweights.transfer.staging_device import staging_device_for
from p2pweights.transfer.transports import create_transport

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


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
        logs.configure()  # P2PWEIGHTS_LOG, and third-party noise kept out
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
        self._collective = Collective(
            self._rank_name,
            agree,
            gather,
            stage=self.config.pipeline_stage,
            num_stages=self.config.num_pipeline_stages,
        )
        self._staging_device = staging_device_for(self.config.transport, staging_device)
        self._executor: TransferExecutor | None = None
        self._fleet = Fleet([])
        self._write_check = WriteCheck()
        """The engines whose writes are verified after each update's end."""
        self._unverified_warned: set[str] = set()
        """Engines warned about as unverified: once per session (``WriteCheck.warned``)."""
        self._replicas: dict[Hashable, ReplicaHandle] = {}
        self._targets: Targets = {}
        self._expected: list[tuple[ExpectedCheckpoint, torch.dtype | None]] = []
        self._prepared: Prepared | None = None
        """The first update's contract, groups and byte plan (None until it was prepared)."""
        self._next_version = 1
        self._checked = False
        self._orphans: dict[str, EngineUpdate] = {}
        """Engines of an earlier connect not connected now, until abort() releases them."""
        self._last_run: RunResult | None = None
        self._receipts = Receipts()
        """The running update's inputs as received (``source.receipts``)."""
        self._one_call = OneCall()
        """connect, update, abort and close run one at a time (``one_call``)."""
        self._cancel = self._one_call.cancel
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

        Raises ``SessionBusyError`` (doing nothing) while another call of this session
        (``update``, ``connect``, ``abort``, ``close``) runs, in any thread.
        """
        with self._one_call.refusing("connect"):
            self._connect(engines)

    def _connect(self, engines: Sequence[str | EngineEndpoint]) -> None:
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
            check_one_model(fleet.engines)
            # a delta an engine refused is seen only through its record: checked always
            verify = "always" if config.delta and config.verify_writes == "auto" else None
            write_check = WriteCheck.connect(
                fleet.engines, verify or config.verify_writes, self._unverified_warned
            )
            if self._executor is None:
                transport = create_transport(config.transport)
                self._executor = TransferExecutor(
                    transport, self._staging_device, config.transfer_timeout_s, config.delta
                )
            targets = assign(
                fleet.engines, config.num_trainer_ranks, config.trainer_rank, self._replica
            )
            pubs = [pub for key_pubs in targets.values() for pub in key_pubs]
            self._executor.connect(pubs)  # drops what is no longer a target
            if targets:  # an idle trainer rank stages nothing
                replicas = [self._replicas[key] for key in targets]
                self._executor.reserve(staging_bytes(replicas, config.buffer_bytes))
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
        self._fleet, self._targets, self._write_check = fleet, targets, write_check
        self._expected = engine_checkpoints(fleet.engines)
        self._next_version = max(self._next_version, fleet.next_numeric_version())
        logger.info(
            "connected to %d engine(s); trainer rank %d writes %d engine rank(s), %d replica(s)",
            len(fleet.engines),
            config.trainer_rank,
            sum(len(pubs) for pubs in targets.values()),
            len(targets),
        )

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
        by tensor.

        Every tensor must keep its bytes from when ``update`` receives it (the call, for a
        mapping or sequence; its yield, for an iterator) until ``update`` returns: bytes
        are read when their staging buffer is flushed, after later tensors were read. An
        iterator must not refill a buffer whose tensors it already yielded (yield a fresh
        buffer per bucket, or copies). Writes through torch are detected (each tensor's
        version counter and data pointer, recorded on receipt, are checked right before
        its bytes are read: in-place ops on it, its base or any view of its storage, even
        of another part of a shared bucket buffer; ``copy_``; ``out=``; ``.data =``;
        ``set_``) and fail the update with ``InputChangedError`` naming the tensor, before
        any engine resumes under the new version. Writes that bypass torch's version
        counter (through ``.numpy()`` or DLPack views, a kernel or transport writing by
        address) are not detected.

        Engines are paused only once the first staging buffer is loaded: reading and
        checking the inputs, converting them (fp8) and staging the first buffer happen
        while they still generate (with several sending trainer ranks and an
        iterator, which may run collectives as it is read, they pause first).

        After a failed update the engines stay paused (their weight version says
        ``p2pweights-updating:<version>``); the next ``update`` rewrites every weight
        and resumes them, or ``abort()`` gives up. ``abort()`` from another thread
        cancels a running update: it stops before its writes or at its next
        parameter group and raises ``TransferError``, and then ``abort()`` does its work
        (an update past its writes completes first). While another call of this session
        (``update``, ``connect``, ``abort``, ``close``) runs, in any thread, ``update``
        raises ``SessionBusyError`` and does nothing.
        """
        with self._one_call.refusing("update"):
            try:
                return self._update(named_tensors, version)
            except BaseException:
                if self._executor is not None:
                    self._executor.forget_deltas()  # failed after its writes too: next is full
                raise

    def _update(self, named_tensors: NamedTensors, version: str | None) -> UpdateReport:
        if not self._fleet.engines or self._executor is None:
            raise ConfigError("call connect(engines) before update()")
        started = time.perf_counter()
        stages: dict[str, float] = {}
        first = self._prepared is None
        self._receipts = Receipts()
        tensors, described = _read_input(named_tensors, first, self._receipts)
        given = tensors if isinstance(tensors, list) else None
        whole = given is not None  # checked whole in prepare, not again as it streams
        # every rank takes this step (an iterator is checked as it streams): ranks must
        # run the same collectives whatever each one was given
        with _timed(stages, "probe" if first else "check_inputs"):
            try:
                self._collective.step("prepare", lambda: self._prepare(given, described))
            except BaseException as exc:
                if first:  # every rank probes again next time: they must gather alike
                    self._prepared = None
                elif isinstance(exc, ConfigError) and len(exc.args) == 1:
                    exc.args = (f"{exc.args[0]}. {_LEFT_RUNNING}",)
                raise
        _, prepared = self._ready()
        version = version or str(self._next_version)
        # Streamed into several ranks, the input may run collectives as it is read: the
        # ranks open together before reading it, not each at its own first flush.
        stream_first = self.config.stage_before_pause and (whole or self.config.num_senders == 1)
        if not stream_first:
            with _timed(stages, "control_plane"):
                self._collective.step("open", lambda: self._open(version))
        try:
            result = self._collective.step(
                "write", lambda: self._write(tensors, whole, version, stream_first, stages)
            )
        except BaseException:
            prepared.source.forget_regions()  # a loader may have to run again: quantize whole
            if self._leader:
                self._fleet.writes_landed(self._landed_alone)
            raise
        try:
            prepared.source.learn_regions(self._replicas)
        except Exception:  # only an optimisation: the writes landed, the update goes on
            logger.warning("p2pweights: fp8 regions not learned; quantizing whole", exc_info=True)
            prepared.source.forget_regions()
        if self._leader:
            self._fleet.writes_landed(lambda url: True)  # every rank's writes landed
        self._complete(version, result, stages)
        self._next_version = _next_version_after(version, self._next_version)
        report = self._report(version, result, stages, time.perf_counter() - started)
        logger.info("p2pweights update %s", report.summary())
        return report

    def _complete(self, version: str, result: RunResult, stages: dict[str, float]) -> None:
        """The steps after the writes: close, verify the writes, check, finish."""
        with _timed(stages, "control_plane"):
            self._collective.step("close", self._close)
        if self._write_check:
            with _timed(stages, "verify_writes"):
                self._verify_writes(version, result)
            stages["digest"] = result.digest_s
            stages["engine_digest"] = self._write_check.engine_digest_s
        if self.config.check_weight_update_equal and not self._checked:
            with _timed(stages, "verify"):
                self._collective.step("check", self._check)
            # once, after it passed on every engine: later updates send other weights than
            # the snapshot's; a failed check is run again by the retry
            self._checked = True
        with _timed(stages, "control_plane"):
            self._collective.step("finish", lambda: self._finish(version))

    def _report(
        self, version: str, result: RunResult, stages: dict[str, float], seconds: float
    ) -> UpdateReport:
        stages["load"], stages["wait"] = result.load_s, result.wait_s
        if result.delta is not None:
            stages["delta_compare"] = result.delta_s
        calls = self._fleet.control_calls() if self._leader else ControlCalls()
        weight_checked = "verify" in stages  # the engines' weight check ran, and passed
        written = set(result.bytes_by_target)

        def verification(url: str) -> tuple[tuple[Verification, ...], str | None]:
            why = self._write_check.verification(url, written, result.digests)
            by: tuple[Verification, ...] = () if why else ("write_digests",)
            return by + (("weight_check",) if weight_checked else ()), why

        assert self._executor is not None
        # what the transport writes over, as set up (Mooncake's "auto" resolved)
        protocol = self._executor.transport.protocol or self.config.protocol
        engines = self._fleet.engine_reports(
            result.bytes_by_target,
            self.config.transport.kind,
            protocol,
            verification,
            drives=self._leader,
        )
        self._write_check.warn_unverified(engines.values())
        return UpdateReport(
            version=version,
            bytes_by_target=dict(result.bytes_by_target),
            stage_seconds=stages,
            seconds=seconds,
            engines=engines,
            delta=None if result.delta is None else DeltaReport.of(result.delta),
            num_control_calls=calls.num_calls,
            control_call_seconds=calls.wall_seconds,
        )

    def _prepare(
        self,
        tensors: list[tuple[str, torch.Tensor]] | None,
        described: dict[str, InputSpec] | None = None,
    ) -> None:
        """Check the whole input (None: an iterator, checked as it streams); on the first
        update also probe the loaders and plan, from the input or from what a described
        iterator says it will yield."""
        if self._prepared is not None:
            if tensors is not None:
                self._prepared.source.check_whole(tensors)
            return
        if tensors is None and described is None:
            raise ConfigError(
                "a first update must be read whole or say what it will yield (specs()) "
                "before it is planned"
            )
        own: dict[str, InputSpec] | None = None
        error: Exception | None = None
        try:
            own = describe_inputs(tensors) if tensors is not None else dict(described or {})
            check_against_checkpoints(own, self._expected)
        except Exception as exc:  # raised after the gather: every rank must take part
            error = exc
        specs = self._collective.stage_inputs(None if error else own)
        if error is not None:
            raise error
        if own is None or specs is None:
            return  # another rank failed before the gather; agree() fails the step
        prepared = prepare(
            own,
            specs,
            {key: self._replicas[key] for key in self._targets},
            self._targets,
            [expected for expected, _ in self._expected if expected is not None],
            buffer_bytes=self.config.buffer_bytes,
            finite=self.config.check_finite,
        )
        if tensors is not None:
            prepared.source.check_whole(tensors)
        if self._executor is None:
            raise _not_connected()
        if self._targets:
            self._executor.reserve(prepared.plan.buffer_bytes)
        self._prepared = prepared

    def _open(self, version: str) -> None:
        if not self._leader:
            return
        # each engine snapshots and resets once (it records that), before the first check
        snapshot = self.config.check_weight_update_equal and not self._checked
        self._fleet.open(self.config.pause_mode, version, snapshot)

    def _write(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        checked: bool,
        version: str,
        stream_first: bool,
        stages: dict[str, float],
    ) -> RunResult:
        """Stage, open the engines (if not open yet) once the first buffer is loaded, write.

        Every rank takes the open step exactly once, also when it failed before its
        first buffer was loaded (then with its error), so ranks agree alike."""
        _, prepared = self._ready()
        self._last_run = None
        opened = not stream_first
        writing = False  # the engines were opened and counted as written (torn on failure)

        def before_writes() -> BytePlan | None:
            nonlocal opened, writing
            self._raise_if_cancelled("write")  # abort() came while preparing or staging
            with _timed(stages, "control_plane"):
                if not opened:
                    opened = True
                    self._collective.step("open", lambda: self._open(version))
                others_write = self.config.num_senders > 1
                if self._leader and others_write:  # they write even if this rank's refresh fails
                    self._fleet.mark_written()
                replanned = self._refresh_targets()  # the sessions are open now
            if self._leader and not others_write:  # alone, a failed refresh left them whole
                self._fleet.mark_written()
            writing = True
            return replanned

        try:
            if not self._targets:  # an idle trainer rank writes nothing, but reads its input
                before_writes()
                inputs = prepared.source.ready(
                    tensors, prepared.plan, checked=checked, receipts=self._receipts
                )
                for _ in inputs:
                    pass
                return RunResult()
            result = self._run(tensors, checked, before_writes)
        except BaseException as exc:
            if isinstance(exc, ConfigError) and len(exc.args) == 1:
                # bad input found as the input streamed: say what that left the engines in
                # (the class kept, for callers that catch it)
                left = _LEFT_TORN if writing else _LEFT_PAUSED if opened else _LEFT_RUNNING
                exc.args = (f"{exc.args[0]}. {left.format(version=version)}",)
            if not opened and isinstance(exc, Exception):
                # only where no stream is drained below (stream_first rules it out), as
                # this step raises
                opened = True
                self._collective.step("open", functools.partial(_raise, exc))
            if self.config.num_senders > 1 and isinstance(tensors, Iterator):
                # A stream may run collectives as it is read (FSDP2 gathers bucket by
                # bucket): every rank must read it to the end, or the others hang in them.
                for _ in tensors:
                    pass
            raise
        finally:
            if prepared.source.convert_s:
                stages["convert"] = prepared.source.convert_s
        return result

    def _run(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        checked: bool,
        before_writes: Callable[[], BytePlan | None],
    ) -> RunResult:
        executor, prepared = self._ready()
        total = sum(prepared.plan.bytes_by_target.values())
        with progress("p2pweights update", total, unit="B", unit_scale=True) as advance:
            result = executor.run(
                prepared.plan,
                prepared.source.ready(
                    tensors, prepared.plan, checked=checked, receipts=self._receipts
                ),
                checked_loaders(self._replicas, self._receipts),
                RunHooks(
                    progress=advance,
                    before_writes=before_writes,
                    cancel=self._cancel,
                    digest_staged=bool(self._write_check),
                ),
            )
        self._last_run = result
        result.raise_if_failed()
        return result

    def _refresh_targets(self) -> BytePlan | None:
        """Where a live publication moved (the engine gave parameters new storage when
        its session opened): connect and plan into the new addresses; the new plan, or
        None if nothing moved. Connected and planned first, then kept: a failure here
        leaves the old targets, so the next update sees the move again and retries it."""
        executor, prepared = self._ready()
        targets = moved(self._targets, self._fleet.engines, self._replicas)
        if targets is None:
            return None
        executor.connect([pub for pubs in targets.values() for pub in pubs])
        plan = build_plan(prepared.groups, self._replicas, targets, self.config.buffer_bytes)
        self._targets, prepared.plan = targets, plan
        return plan

    def _ready(self) -> tuple[TransferExecutor, Prepared]:
        """The executor and the prepared update an update's steps work with."""
        if self._executor is None or self._prepared is None:  # only a bug gets here now
            raise _not_connected()
        return self._executor, self._prepared

    def _raise_if_cancelled(self, where: str) -> None:
        if self._cancel.is_set():
            raise TransferError(
                f"{self._rank_name}: the update was cancelled by abort() from another thread "
                f"(at its '{where}' step)"
            )

    def _landed_alone(self, url: str) -> bool:
        """After a failed write step: whether ``url`` surely got all its bytes. Only a lone
        trainer rank knows (with several, another rank may have failed it)."""
        run = self._last_run
        return self.config.num_senders == 1 and run is not None and run.complete(url)

    def _close(self) -> None:
        if self._leader:
            self._fleet.close()

    def _verify_writes(self, version: str, result: RunResult) -> None:
        """Every rank compares the digests its engine ranks took before their end with
        those of the bytes it staged for them, and all agree. An engine found wrong stays
        torn (``incomplete``, ``check_failed``); where another rank failed, every
        checked engine does (rank 0 cannot know which it found wrong)."""
        found: list[Mismatch] = []

        def check() -> None:
            found.extend(self._write_check.check(result.digests, updating_version(version)))
            WriteCheck.raise_if_wrong(found)

        try:
            self._collective.step("verify_writes", check)
        except BaseException:
            if self._leader:
                alone = self.config.num_senders == 1 and bool(found)
                wrong = {m.runner[0] for m in found} if alone else set(self._write_check.engines)
                self._fleet.writes_wrong(wrong)
            raise

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
        engine calls by their time limits) before giving up as above. While ``connect``,
        ``abort`` or ``close`` runs in another thread it waits for that to return. Called
        on the thread of a running call (from ``update()``'s input iterator, a signal
        handler) it raises ``SessionBusyError`` instead of waiting forever (a running
        update is still cancelled).
        """
        with self._one_call.waiting("abort"):
            return self._abort(resume_incomplete)

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
        self._targets, self._prepared, self._write_check = {}, None, WriteCheck()
        # the weight check stays done: it compares the session's first update with the
        # engines' start weights; a reconnect's next update sends trained weights

    def close(self) -> None:
        """``abort()``, then release connections, writer threads and the transport (an
        update running in another thread is cancelled and waited for first, any other
        call waited for, as ``abort()`` does). ``connect()`` opens the session again."""
        with self._one_call.waiting("close"):
            try:
                self._abort(resume_incomplete=False)
            except Exception as exc:  # closing must not hide the error that led here
                logger.warning("p2pweights close: abort failed: %r", exc)
            self._disconnect()
            if self._executor is not None:
                transport = self._executor.transport
                self._executor.close()
                in_flight = sorted(self._executor.unsettled_targets)
                if in_flight:  # a later session cannot know: say it here
                    logger.warning(
                        "p2pweights close: writes to %s may still land; they stay torn (left "
                        "paused), and a new session must not write them before those ended",
                        ", ".join(f"{url} rank {rank}" for url, rank in in_flight),
                    )
                transport.close()
                self._executor = None

    def __enter__(self) -> WeightSyncSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _read_input(
    named_tensors: NamedTensors, first: bool, receipts: Receipts
) -> tuple[Iterable[tuple[str, torch.Tensor]], dict[str, InputSpec] | None]:
    """The update's pairs, as a list where they are read whole (a mapping or sequence;
    a first update's iterator that does not say what it will yield, which must be known
    whole before it is planned), else the iterator; and what a first update's iterator
    says it will yield (``specs()``). What is read whole is recorded in ``receipts`` as
    it is read (an iterator's tensors as each is yielded)."""
    if isinstance(named_tensors, torch.Tensor):
        raise ConfigError("update() takes (hf_name, tensor) pairs or a name -> tensor mapping")
    if isinstance(named_tensors, Mapping):
        return list(receipts.recording(named_tensors.items())), None
    if not isinstance(named_tensors, Iterator):
        return list(receipts.recording(named_tensors)), None
    described = described_inputs(named_tensors) if first else None
    if first and described is None:
        return list(receipts.recording(named_tensors)), None
    return named_tensors, described


@contextmanager
def _timed(stages: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - started


def _not_connected() -> ConfigError:
    return ConfigError("call connect(engines) before update() (or again, after close())")


_LEFT_RUNNING = "No engine was paused or written: they serve the previous weights"
_LEFT_PAUSED = (
    "The engines were paused for this update but not written: they keep the previous "
    "weights, paused (weight version 'p2pweights-updating:{version}'), until the next "
    "update() or abort() resumes them"
)
_LEFT_TORN = (
    "The engines were already paused for this update's writes: they stay paused, with "
    "torn weights and the weight version 'p2pweights-updating:{version}', until the next "
    "update() rewrites them whole (session.abort(resume_incomplete=True) resumes them "
    "torn)"
)


def _raise(error: Exception) -> None:
    raise error


def _next_version_after(version: str, current: int) -> int:
    """Auto-versions continue past a numeric version, and never go backwards."""
    try:
        return max(current, int(version) + 1)
    except ValueError:
        return current  # a named version ("step-9") uses up no number


__all__ = ["WeightSyncSession"]
