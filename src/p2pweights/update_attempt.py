"""One call of ``WeightSyncSession.update``: the steps every sending trainer rank takes.

An ``UpdateAttempt`` owns what one update needs and leaves behind: its version, the
inputs as received (``source.receipts``), the seconds of its stages and the result of
its writes. It runs, each step through ``Collective.step`` so all ranks agree on it:

    prepare: the inputs read and checked (the first update also probes and plans)
    open:    the engines paused, marked and begun (trainer rank 0 drives them), once the
             first staging buffer is loaded (or before it, where a stream may run
             collectives as it is read)
    write:   every engine rank's bytes (``transfer.executor``)
    verify_checker (engines without write digests: sglang's ``/weights_checker``
             checksums of what was written, before any end), close, verify_writes
             (write digests), check (first update, when asked), finish

and says, when bad input stops it, what that left the engines in. The connection
(``connection.Connection``) it writes through outlives it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from contextlib import contextmanager
from typing import TypeVar

import torch

from p2pweights.adapters.owned import owned_names, shard_ranges
from p2pweights.collective import Collective
from p2pweights.engines.calls import ControlCalls
from p2pweights.engines.update_state import updating_version
from p2pweights.errors import ConfigError, TransferError
from p2pweights.plan.byte_plan import BytePlan
from p2pweights.plan.owners import Claim, Ownership
from p2pweights.plan.prepare import check_against_checkpoints, prepare, prepare_owned
from p2pweights.progress import progress
from p2pweights.report import DeltaReport, UpdateReport, Verification
from p2pweights.source.inputs import InputSpec, describe_inputs, described_inputs
from p2pweights.source.receipts import Receipts, checked_loaders
from p2pweights.sync_connection import Connection, not_connected
from p2pweights.transfer.executor import RunHooks, RunResult
from p2pweights.verification.checker import CheckerShare
from p2pweights.verification.checksums import StagedChecksums
from p2pweights.verification.staged import with_shares
from p2pweights.verification.update_checks import UpdateChecks
from p2pweights.wire.publication import Runner

logger = logging.getLogger(__name__)

__all__ = ["NamedTensors", "UpdateAttempt"]

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
T = TypeVar("T")


def _in_background(call: Callable[[], T]) -> futures.Future[T]:
    """``call()`` on a thread of its own; its result or exception, when asked."""
    pool = futures.ThreadPoolExecutor(1, thread_name_prefix="p2pweights-digests")
    try:
        return pool.submit(call)
    finally:
        pool.shutdown(wait=False)  # the call still runs; the thread ends with it


class UpdateAttempt:
    """One update of every connected engine, from its inputs to its report."""

    def __init__(
        self,
        connection: Connection,
        collective: Collective,
        cancel: threading.Event,
        rank_name: str,
        version: str | None,
        subset: frozenset[str] | None = None,
    ) -> None:
        self.connection = connection
        self.subset = subset  # a partial update's declared HF names (None: every one)
        self.config = connection.config
        self.collective = collective
        self.cancel = cancel  # set by abort(): stop before the writes or at the next group
        self.rank_name = rank_name
        self.version = version or str(connection.next_version)
        self.receipts = Receipts()  # the inputs as received (``source.receipts``)
        self.stages: dict[str, float] = {}
        self.last_run: RunResult | None = None
        self.gathered_bytes: dict[str, int] = {}  # HF name -> bytes received gathering it

    @property
    def leader(self) -> bool:
        """This rank drives the engines' update session."""
        return self.config.leads

    def run(self, named_tensors: NamedTensors) -> UpdateReport:
        """Every step of the update, on this rank; its report."""
        connection = self.connection
        if not connection.fleet.engines or connection.executor is None:
            raise ConfigError("call connect(engines) before update()")
        started = time.perf_counter()
        first = connection.prepared is None
        if self.config.num_senders > 1:  # before any is read: an iterator may gather
            self.collective.same_input_kind(named_tensors)
        # alone, a rank owns everything it sends: nothing to plan by owner
        if self.config.num_senders == 1:
            self._refuse_lone_slices(named_tensors)
        owned = owned_names(named_tensors) if self.config.num_senders > 1 else frozenset()
        shards = shard_ranges(named_tensors) if self.config.num_senders > 1 else {}
        whole = getattr(named_tensors, "whole_tensors", None)
        if shards and callable(whole):  # slices are yielded as held unless asked for whole
            named_tensors = whole()
        tensors, described = read_input(named_tensors, first, self.receipts)
        given = tensors if isinstance(tensors, list) else None
        whole = given is not None  # checked whole in prepare, not again as it streams
        # every rank takes this step (an iterator is checked as it streams): ranks must
        # run the same collectives whatever each one was given
        with self._timed("probe" if first else "check_inputs"):
            try:
                self.collective.step(
                    "prepare", lambda: self._prepare(given, described, owned, shards)
                )
            except BaseException as exc:
                if first:  # every rank probes again next time: they must gather alike
                    connection.prepared = None
                    # and plans from its own share of the engine ranks (owner sends
                    # widened it to every engine rank before failing)
                    connection.targets = connection.assigned
                elif isinstance(exc, ConfigError) and len(exc.args) == 1:
                    exc.args = (f"{exc.args[0]}. {_LEFT_RUNNING}",)
                raise
        _, prepared = connection.ready()
        gathered = prepared.owned.gathered if prepared.owned is not None else frozenset()
        gathers = bool(gathered)
        if gathers:  # owner sends' one-tensor gathers run as the input is read
            tensors = self._gathering(tensors, gathered, prepared.owned_shards)
        # Streamed into several ranks, the input may run collectives as it is read: the
        # ranks open together before reading it, not each at its own first flush.
        stream_first = self.config.stage_before_pause and (
            (whole and not gathers) or self.config.num_senders == 1
        )
        if not stream_first:
            with self._timed("control_plane"):
                self.collective.step("open", self._open)
        try:
            result = self.collective.step(
                "write", lambda: self._write(tensors, whole, stream_first)
            )
        except BaseException as exc:
            prepared.source.forget_regions()  # a loader may have to run again: quantize whole
            if self.leader:
                connection.fleet.writes_sent(self._landed_alone)
                if isinstance(exc, Exception):
                    self._settle_whole_alone()
            raise
        try:
            prepared.source.learn_regions(connection.replicas)
        except Exception:  # only an optimisation: the writes landed, the update goes on
            logger.warning("p2pweights: fp8 regions not learned; quantizing whole", exc_info=True)
            prepared.source.forget_regions()
        if self.leader:  # every rank's writes landed; whole once ended and verified
            connection.fleet.writes_sent(lambda url: True)
        self._complete(result)
        connection.next_version = _next_version_after(self.version, connection.next_version)
        return self._report(result, time.perf_counter() - started)

    def _refuse_lone_slices(self, named_tensors: object) -> None:
        """A lone sender must send whole tensors: a slice (``shards()``) would reach the
        engines as its tensor, zero outside it."""
        specs = getattr(named_tensors, "specs", None)
        full = dict(specs()) if callable(specs) else {}
        for name, (dim, start, stop) in sorted(shard_ranges(named_tensors).items()):
            size = full[name][0][dim] if name in full else stop
            if (start, stop) != (0, size):
                raise ConfigError(
                    f"{self.rank_name} holds only rows {start}..{stop} (dim {dim}) of HF "
                    f"tensor {name!r}, but it is the only sending trainer rank: make every "
                    f"holder a sender (WeightSyncSession.from_torch_distributed), or send "
                    f"whole tensors (hf_named_tensors(model, owned=False)); nothing was sent"
                )

    def _gathering(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        gathered: frozenset[str],
        held: Mapping[str, tuple[int, int, int]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``tensors``, with each sharded tensor its holders cannot write alone
        (``OwnedPlan.gathered``) whole, all-gathered from every holder's slice as it is
        read; the bytes received, per tensor, in ``self.gathered_bytes``."""
        for name, tensor in tensors:
            if name in gathered and isinstance(tensor, torch.Tensor):
                with self._timed("gather"):
                    tensor, received = self.collective.gathered_tensor(name, tensor, held[name])
                self.gathered_bytes[name] = received
            yield name, tensor

    def _prepare(
        self,
        tensors: list[tuple[str, torch.Tensor]] | None,
        described: dict[str, InputSpec] | None = None,
        owned: frozenset[str] = frozenset(),
        shards: dict[str, tuple[int, int, int]] | None = None,
    ) -> None:
        """Check the whole input (None: an iterator, checked as it streams); on the first
        update also probe the loaders and plan, from the input or from what a described
        iterator says it will yield (and owns: ``plan.owners``)."""
        connection = self.connection
        if connection.prepared is not None:
            if self.subset is not None:
                connection.prepared.source.check_subset(self.subset)
            was = connection.prepared.owned_inputs
            held = connection.prepared.owned_shards
            if self.subset is not None:  # a partial update owns and holds what it sends
                was = was & self.subset
                held = {name: found for name, found in held.items() if name in self.subset}
            if shards and shards != held:
                raise ConfigError(
                    f"{self.rank_name} holds other slices than at the first update; the "
                    f"holders are planned once: connect() again to plan new ones"
                )
            if owned != was:
                raise ConfigError(
                    f"{self.rank_name} owns other HF tensors than at the first update "
                    f"({sorted(owned ^ was)[:3]} changed); the owners are planned once: "
                    f"connect() again to plan new ones"
                )
            if tensors is not None:
                connection.prepared.source.check_whole(tensors, self.subset)
            return
        if self.subset is not None:
            raise ConfigError(
                "the first update sends every HF tensor (it is checked against the engines' "
                "checkpoint and fixes what later updates send); pass subset= from the second on"
            )
        if tensors is None and described is None:
            raise ConfigError(
                "a first update must be read whole or say what it will yield (specs()) "
                "before it is planned"
            )
        own: dict[str, InputSpec] | None = None
        error: Exception | None = None
        try:
            own = describe_inputs(tensors) if tensors is not None else dict(described or {})
            check_against_checkpoints(own, connection.expected)
        except Exception as exc:  # raised after the gather: every rank must take part
            error = exc
        me = (self.config.pipeline_stage, self.config.trainer_rank)
        claimed = self.collective.claims(
            None if error or own is None else Claim(me, own, owned, shards or {})
        )
        if error is not None:
            raise error
        if own is None or claimed is None:
            return  # another rank failed before the gather; agree() fails the step
        specs, ownership = claimed
        if ownership:
            self._prepare_owned(own, specs, ownership, tensors)
            return
        prepared = prepare(
            own,
            specs,
            {key: connection.replicas[key] for key in connection.targets},
            connection.targets,
            [expected for expected, _ in connection.expected if expected is not None],
            buffer_bytes=self.config.buffer_bytes,
            finite=self.config.verify_finite_inputs,
        )
        if tensors is not None:
            prepared.source.check_whole(tensors)
        if connection.executor is None:
            raise not_connected()
        if connection.targets:
            connection.executor.reserve(prepared.plan.buffer_bytes)
        connection.prepared = prepared

    def _prepare_owned(
        self,
        own: dict[str, InputSpec],
        specs: dict[str, InputSpec],
        ownership: Ownership,
        tensors: list[tuple[str, torch.Tensor]] | None,
    ) -> None:
        """The first update's plan under owner sends (``plan.owners``)."""
        connection = self.connection
        if self.config.delta is not None:
            raise ConfigError(
                "owner sends write each engine rank from several trainer ranks, but a delta "
                "update writes one payload per engine rank; use delta=None with owned tensors"
            )
        connection.write_to_every()
        prepared = prepare_owned(
            own,
            specs,
            ownership,
            (self.config.pipeline_stage, self.config.trainer_rank),
            {key: connection.replicas[key] for key in connection.targets},
            connection.targets,
            connection.assigned,
            [expected for expected, _ in connection.expected if expected is not None],
            buffer_bytes=self.config.buffer_bytes,
            finite=self.config.verify_finite_inputs,
        )
        shared = next((g for g in prepared.plan.groups.values() if g.partial), None)
        if shared is not None:
            connection.write_check.refuse_shared_parameters(
                self.config.digest_as_written,
                f"parameter {shared.slots[0].param!r} of HF tensors {sorted(shared.hf_names)[:3]}",
            )
        me = (self.config.pipeline_stage, self.config.trainer_rank)
        prepared.owned_inputs = frozenset(n for n, o in ownership.owners.items() if o == me)
        prepared.owned_shards = {
            name: held[me] for name, held in ownership.shards.items() if me in held
        }
        if tensors is not None:
            prepared.source.check_whole(tensors)
        assert connection.executor is not None
        connection.executor.reserve(prepared.plan.buffer_bytes)
        connection.prepared = prepared

    def _open(self) -> None:
        if not self.leader:
            return
        # each engine snapshots and resets once (it records that), before the first check
        snapshot = self.config.verify_with_weight_checker and not self.connection.checked
        self.connection.fleet.open(self.config.pause_mode, self.version, snapshot)

    def _write(
        self, tensors: Iterable[tuple[str, torch.Tensor]], checked: bool, stream_first: bool
    ) -> RunResult:
        """Stage, open the engines (if not open yet) once the first buffer is loaded, write.

        Every rank takes the open step exactly once, also when it failed before its
        first buffer was loaded (then with its error), so ranks agree alike."""
        connection = self.connection
        _, prepared = connection.ready()
        self.last_run = None
        opened = not stream_first
        writing = False  # the engines were opened and counted as written (torn on failure)

        def before_writes() -> BytePlan | None:
            nonlocal opened, writing
            self._raise_if_cancelled("write")  # abort() came while preparing or staging
            with self._timed("control_plane"):
                if not opened:
                    opened = True
                    self.collective.step("open", self._open)
                others_write = self.config.num_senders > 1
                if self.leader and others_write:  # they write even if this rank's refresh fails
                    connection.fleet.mark_written()
                replanned = connection.refresh_targets()  # the sessions are open now
                if connection.write_check:  # a session's first update: the records' numbers
                    connection.write_check.note_begun(
                        pub.runner for pubs in connection.targets.values() for pub in pubs
                    )
            if self.leader and not others_write:  # alone, a failed refresh left them whole
                connection.fleet.mark_written()
            writing = True
            return replanned

        try:
            if not connection.targets:  # an idle trainer rank writes nothing, but reads its input
                before_writes()
                inputs = prepared.source.ready(
                    tensors,
                    prepared.plan,
                    checked=checked,
                    receipts=self.receipts,
                    subset=self.subset,
                )
                for _ in inputs:
                    pass
                return RunResult()
            result = self._run(tensors, checked, before_writes, paused=not stream_first)
        except BaseException as exc:
            if isinstance(exc, ConfigError) and len(exc.args) == 1:
                # bad input found as the input streamed: say what that left the engines in
                # (the class kept, for callers that catch it)
                left = _LEFT_TORN if writing else _LEFT_PAUSED if opened else _LEFT_RUNNING
                exc.args = (f"{exc.args[0]}. {left.format(version=self.version)}",)
            if not opened:
                # only where no stream is drained below (stream_first rules it out), as
                # this step raises (an interrupt too: the others wait in its agreement)
                opened = True
                self.collective.step("open", functools.partial(_raise, exc))
            if self.config.num_senders > 1 and isinstance(tensors, Iterator):
                # A stream may run collectives as it is read (FSDP2 gathers bucket by
                # bucket): every rank must read it to the end, or the others hang in them.
                for _ in tensors:
                    pass
            raise
        finally:
            if prepared.source.convert_s:
                self.stages["convert"] = prepared.source.convert_s
        return result

    def _run(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        checked: bool,
        before_writes: Callable[[], BytePlan | None],
        paused: bool = False,
    ) -> RunResult:
        connection = self.connection
        executor, prepared = connection.ready()
        total = sum(prepared.plan.bytes_by_target.values())
        with progress("p2pweights update", total, unit="B", unit_scale=True) as advance:
            result = executor.run(
                prepared.plan,
                prepared.source.ready(
                    tensors,
                    prepared.plan,
                    checked=checked,
                    receipts=self.receipts,
                    subset=self.subset,
                ),
                checked_loaders(connection.replicas, self.receipts),
                RunHooks(
                    progress=advance,
                    before_writes=before_writes,
                    cancel=self.cancel,
                    digest_staged=bool(connection.write_check),
                    checksums=StagedChecksums(connection.write_check.checker_devices),
                    flag_landed=connection.write_check.flagged(self.config.digest_as_written),
                    paused_before=paused,
                ),
            )
        self.last_run = result
        result.raise_if_failed()
        return result

    def _raise_if_cancelled(self, where: str) -> None:
        if self.cancel.is_set():
            raise TransferError(
                f"{self.rank_name}: the update was cancelled by abort() from another thread "
                f"(at its '{where}' step)"
            )

    def _settle_whole_alone(self) -> None:
        """After a failed write step, on a lone trainer rank: the engines that received
        every byte are ended and checked (``UpdateChecks.after_failed_writes``). With
        several ranks no rank knows which engines got every byte: all stay torn."""
        run = self.last_run
        self._checks().after_failed_writes(None if run is None else lambda: run.digests)

    @property
    def _weight_check_pending(self) -> bool:
        """This update is to be compared by the engines' own weight check (a first update
        with ``verify_with_weight_checker``), which has not passed yet."""
        return self.config.verify_with_weight_checker and not self.connection.checked

    def _landed_alone(self, url: str) -> bool:
        """After a failed write step: whether ``url`` surely got all its bytes. Only a lone
        trainer rank knows (with several, another rank may have failed it)."""
        run = self.last_run
        return self.config.num_senders == 1 and run is not None and run.complete(url)

    def _complete(self, result: RunResult) -> None:
        """The steps after the writes: close, verify the writes, check, finish."""
        connection, stages = self.connection, self.stages
        checks = self._checks()
        # this rank hashes its digests while the engines end (and take theirs); a failure
        # there fails the verify step, which every rank takes
        if connection.write_check.checker:  # before end: sglang re-lays the weights there
            with self._timed("verify_checker"):
                self._verify_before_end(result)
            stages["checksum"] = result.checksum_s
        hashed = _in_background(lambda: result.digests) if connection.write_check else None
        not_closed: Exception | None = None  # the engines that did end are still verified
        try:
            with self._timed("control_plane"):
                self.collective.step("close", self._close)
        except Exception as exc:
            not_closed = exc
        except BaseException:
            if hashed is not None:
                futures.wait([hashed])  # nothing of this update runs on after it failed
            raise
        try:
            if hashed is not None:
                with self._timed("verify_writes"):
                    checks.after_end(lambda: self._staged_digests(hashed), self.collective.step)
                stages["digest"] = result.digest_s
                stages["engine_digest"] = connection.write_check.engine_digest_s
        except Exception:
            checks.settle(failed=True, all_ended=not_closed is None)
            if not_closed is None:
                raise
            logger.warning("p2pweights: write verification after a failed end", exc_info=True)
        else:
            checks.settle(failed=False, all_ended=not_closed is None)
        if not_closed is not None:
            raise not_closed
        if self.config.verify_with_weight_checker and not connection.checked:
            with self._timed("verify"):
                self.collective.step("check", self._check)
            # once, after it passed on every engine: later updates send other weights than
            # the snapshot's; a failed check is run again by the retry
            connection.checked = True
        with self._timed("control_plane"):
            self.collective.step("finish", self._finish)

    def _close(self) -> None:
        if self.leader:
            self.connection.fleet.close()

    def _verify_before_end(self, result: RunResult) -> None:
        """The ``/weights_checker`` check of the engines without write digests, after every
        rank's writes and before any end (``UpdateChecks.before_end``), each engine's
        checker asked by one rank, its answer gathered by the others."""
        me = (self.config.pipeline_stage, self.config.trainer_rank)
        share = CheckerShare(self.collective.gather, me)
        self._checks().before_end(result.checksums, self.collective.step, share)

    def _staged_digests(
        self, hashed: futures.Future[dict[Runner, dict[str, str]]]
    ) -> dict[Runner, dict[str, str]]:
        """This rank's digests; under owner sends with the digests of the parameters
        several owners write, from every rank's shares summed (one gather, every rank)."""
        prepared, run = self.connection.prepared, self.last_run
        if prepared is None or prepared.owned is None:
            return hashed.result()
        assert run is not None
        return with_shares(hashed.result, lambda: run.partial_digests, self.collective.gather)

    def _checks(self) -> UpdateChecks:
        """This update's write checks (``verification.update_checks``)."""
        return UpdateChecks(
            self.connection.write_check,
            self.connection.fleet,
            updating_version(self.version),
            leader=self.leader,
            alone=self.config.num_senders == 1,
            weight_check_pending=self._weight_check_pending,
        )

    def _check(self) -> None:
        if self.leader:
            self.connection.fleet.compare()

    def _finish(self) -> None:
        if self.leader:
            self.connection.fleet.finish(self.version)

    def _report(self, result: RunResult, seconds: float) -> UpdateReport:
        connection, stages = self.connection, self.stages
        stages["load"], stages["wait"] = result.load_s, result.wait_s
        if result.delta is not None:
            stages["delta_compare"] = result.delta_s
        calls = connection.fleet.control_calls() if self.leader else ControlCalls()
        weight_checked = "verify" in stages  # the engines' weight check ran, and passed
        written = set(result.bytes_by_target)

        def verification(url: str) -> tuple[tuple[Verification, ...], str | None]:
            return connection.write_check.verification(
                url, written, result.digests, result.checksums, weight_checked=weight_checked
            )

        executor, _ = connection.ready()
        # what the transport writes over, as set up (Mooncake's "auto" resolved)
        protocol = executor.transport.protocol or self.config.protocol
        engines = connection.fleet.engine_reports(
            result.bytes_by_target,
            self.config.transport.kind,
            protocol,
            verification,
            drives=self.leader,
        )
        connection.write_check.warn_unverified(engines.values())
        return UpdateReport(
            version=self.version,
            bytes_by_target=dict(result.bytes_by_target),
            stage_seconds=stages,
            seconds=seconds,
            engines=engines,
            delta=None if result.delta is None else DeltaReport.of(result.delta),
            num_control_calls=calls.num_calls,
            control_call_seconds=calls.wall_seconds,
            subset_size=None if self.subset is None else len(self.subset),
            inputs_checked_finite=self.config.verify_finite_inputs,
            gathered_bytes_by_tensor=dict(self.gathered_bytes),
        )

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - started


def read_input(
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


def _raise(error: BaseException) -> None:
    raise error


def _next_version_after(version: str, current: int) -> int:
    """Auto-versions continue past a numeric version, and never go backwards."""
    try:
        return max(current, int(version) + 1)
    except ValueError:
        return current  # a named version ("step-9") uses up no number
