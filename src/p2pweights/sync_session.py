"""``WeightSyncSession``: connect to engines once, then push every training step's weights.

The session only sequences. What a connection keeps (the engines, this rank's targets,
the replicas, the executor) is ``connection.Connection``; the steps of one update are
``update_attempt.UpdateAttempt``; the engines' update state (``engines``), the rank
assignment and the byte plan (``plan``), the trainer's tensors (``source``) and
staging and writing (``transfer``) live below those.

One update, as sglang expects it, each step acting only on engines that need it
(``engines.update_state`` keeps every engine's state from its own answers)::

    stage:  the inputs read, checked, converted; the first staging buffer loaded
    open:   pause_generation -> update_weight_version("p2pweights-updating:<v>") and
            flush_cache at once -> begin_weight_update
    write:  every engine rank's bytes
    close:  end_weight_update
    verify: each rank's digests of its staged writes against the engine ranks' own
            (``SyncConfig.verify_writes``; ``p2pweights.verification``)
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

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from p2pweights import logs
from p2pweights.collective import Collective
from p2pweights.config import SyncConfig, TrainerTopology
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.update_state import AbortReport
from p2pweights.errors import ConfigError
from p2pweights.one_call import OneCall
from p2pweights.report import UpdateReport
from p2pweights.sync_connection import Connection
from p2pweights.transfer.staging_device import staging_device_for
from p2pweights.update_attempt import NamedTensors, UpdateAttempt

logger = logging.getLogger(__name__)

__all__ = ["WeightSyncSession"]


class WeightSyncSession:
    """Pushes a trainer's HF-named tensors into connected sglang engines, point to point.

    One session per trainer process: ``connect`` once (again when the engines change),
    then ``update`` after every training step; ``abort`` gives up on a failed update and
    ``close`` (or leaving the ``with`` block) releases everything. One call runs at a
    time; docs/architecture.md ("Calls from several threads") says what a second call
    does.
    """

    def __init__(
        self,
        config: SyncConfig | None = None,
        *,
        topology: TrainerTopology | None = None,
        agree: Callable[[bool], bool] | None = None,
        gather: Callable[[object], list[object]] | None = None,
        staging_device: torch.device | str | None = None,
    ):
        """Make a session; nothing is connected or allocated until ``connect``.

        ``from_torch_distributed`` fills in ``topology``, ``agree`` and ``gather`` for the
        ranks of a ``torch.distributed`` group.

        Args:
            config: The transport, buffers, time limits and checks (default: ``SyncConfig()``).
            topology: Where this process stands among the sending trainer ranks (default:
                the only one); replaces the deprecated ``SyncConfig`` fields of the same
                facts.
            agree: ``agree(ok)`` returns whether every sending trainer rank, of every
                pipeline stage, passed ``True`` (an all-reduce of the flags, e.g.
                ``p2pweights.adapters.torch_agree()``). Required with more than one
                sending rank.
            gather: ``gather(obj)`` returns every sending rank's ``obj`` (picklable), in
                one order on every rank (an all-gather, e.g.
                ``p2pweights.adapters.torch_gather()``). Required with pipeline stages;
                where given, a failed step raises the same error (the first failing
                rank's, naming it) on every rank.
            staging_device: Where the staging buffers live: ``"cpu"`` (pinned host
                memory) or ``"cuda:N"`` where the transport reads GPU memory. Default: the
                GPU of a ``CudaIpcConfig`` transport, else pinned host memory.

        Raises:
            ConfigError: Several sending ranks without ``agree``, or pipeline stages
                without ``gather``.
        """
        logs.apply_log_level()  # P2PWEIGHTS_LOG; nothing process-wide besides (logs.quiet)
        config = config or SyncConfig()
        # the config as this session holds it: its topology filled in
        self.config = config if topology is None else config.with_topology(topology)
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
        staging = staging_device_for(self.config.transport, staging_device)
        self._connection = Connection(self.config, staging)
        self._last_attempt: UpdateAttempt | None = None
        self._one_call = OneCall()  # connect, update, abort and close run one at a time
        # set by abort() while an update runs: it stops before its writes or at its next group
        self._cancel = self._one_call.cancel

    @classmethod
    def from_torch_distributed(
        cls,
        config: SyncConfig | None = None,
        *,
        group: Any = None,
        pipeline_stage: int | None = None,
        num_pipeline_stages: int | None = None,
        staging_device: torch.device | str | None = None,
    ) -> WeightSyncSession:
        """A session for every rank of a ``torch.distributed`` group.

        Every rank of ``group`` sends, and each must call this (it runs one all-gather).
        This rank's place among its stage's ranks, in group order, makes the session's
        ``TrainerTopology``; ``agree`` and ``gather`` run over ``group`` (gloo or NCCL).

        Args:
            config: As for ``WeightSyncSession``.
            group: The ``torch.distributed`` process group of the sending ranks (default:
                the whole world).
            pipeline_stage: The pipeline stage this rank holds (default: the config's).
            num_pipeline_stages: How many stages there are (default: the config's, else
                one: every rank holds the same weights, e.g. FSDP2).
            staging_device: As for ``WeightSyncSession``.

        Returns:
            The session, one on every rank of ``group``.
        """
        from p2pweights.adapters.torch_distributed import (
            torch_agree,
            torch_gather,
            torch_stage_ranks,
        )

        config = config or SyncConfig()
        stage = config.pipeline_stage if pipeline_stage is None else pipeline_stage
        num_stages = (
            config.num_pipeline_stages if num_pipeline_stages is None else num_pipeline_stages
        )
        rank, size = torch_stage_ranks(stage, num_stages, group)
        return cls(
            config,
            topology=TrainerTopology(
                rank=rank, num_ranks=size, pipeline_stage=stage, num_pipeline_stages=num_stages
            ),
            agree=torch_agree(group),
            gather=torch_gather(group),
            staging_device=staging_device,
        )

    @property
    def topology(self) -> TrainerTopology:
        """Where this process stands among the sending trainer ranks."""
        return self.config.topology

    @property
    def _rank_name(self) -> str:
        config = self.config
        if config.num_pipeline_stages == 1:
            return f"trainer rank {config.trainer_rank}"
        return f"pipeline stage {config.pipeline_stage} trainer rank {config.trainer_rank}"

    # -- connect -------------------------------------------------------------------------------

    def connect(self, engines: Sequence[str | EngineEndpoint]) -> None:
        """Read every engine's layout and published weights; prepare this rank's targets.

        Engines are ordered by URL, so every trainer rank plans the same way whatever
        order it lists them in. An engine a previous session left mid-update is adopted:
        the next update rewrites it whole. Called again with another engine list
        (engines added, removed, restarted on new addresses), it reads every engine
        afresh and plans the next update anew; replicas and registered staging buffers
        are kept, and an engine rank no longer listed, or listed with other addresses,
        loses its writer and its transport connection, so nothing is written to a stale
        registration. A failed connect leaves the session unconnected.

        Args:
            engines: sglang server URLs, or ``EngineEndpoint``s where an engine's model
                folder is not readable from the trainer (``model_path``).

        Raises:
            ConfigError: Before any byte moves: an engine published for another transport,
                on another sglang release (unless ``allow_sglang_mismatch``), with a layout
                that cannot be written, or with published parameter sizes other than the
                replica's.
            EngineError: An engine did not answer or answered in error.
            TransportError: The transport could not be set up or connected to an engine
                rank.
            SessionBusyError: Another call of this session runs, in any thread (nothing
                was done).
        """
        with self._one_call.refusing("connect"):
            self._connection.connect(engines)

    def update(
        self,
        named_tensors: NamedTensors,
        *,
        version: str | None = None,
        subset: Collection[str] | None = None,
    ) -> UpdateReport:
        """Write one training step's weights into every connected engine.

        Engines pause only once the first staging buffer is loaded, and resume once every
        engine rank holds the new bytes (checked by the write digests where the engine
        records them). Each tensor must keep its bytes from when ``update`` receives it
        (the call, for a mapping or sequence; its yield, for an iterator) until ``update``
        returns; writes through torch in between are detected, writes that bypass torch's
        version counter (``.numpy()``, DLPack, a kernel writing by address) are not.
        After a failure the engines stay paused, their weight version
        ``p2pweights-updating:<version>``: the next ``update`` rewrites every weight and
        resumes them, or ``abort()`` gives up. docs/architecture.md ("One update") has the
        steps, docs/reliability.md the state each failure leaves.

        Args:
            named_tensors: ``(hf_name, tensor)`` pairs under the checkpoint's names, as a
                mapping, a sequence (both checked whole before any byte is written) or an
                iterator (checked tensor by tensor; it must not refill a buffer whose
                tensors it already yielded), e.g. ``adapters.hf_named_tensors(model)``.
            version: The weight version the engines report afterwards (default: the next
                number after the session's last version).
            subset: A partial update (not the first): exactly the HF names this update
                sends. Only the parameters they feed are written and verified; the engines
                keep every other weight. A name outside it, one of it missing from the
                input, or a parameter group it covers only in part is refused before any
                byte is written. Not with ``SyncConfig.delta`` or pipeline stages.

        Returns:
            What the update did: bytes, seconds by stage, how long each engine stood
            paused, how each was verified (``UpdateReport.summary()`` in one line).

        Raises:
            ConfigError: An input the engines' checkpoint does not describe (name, shape,
                dtype), found before any engine is touched; ``SessionBusyError`` (a
                ``ConfigError``) while another call of this session runs, doing nothing.
            InputChangedError: A tensor written through torch after it was received,
                before any engine resumes under the new version.
            TransferError: A write failed, was refused, or was still running after
                ``timeouts.transfer``; a digest did not match; or ``abort()`` from another
                thread cancelled the update (before its writes or at its next group).
            EngineError: An engine did not answer an update-session call within
                ``timeouts.control``, or answered in error.
            PlanError: No valid assignment of trainer ranks to engine ranks (first update).
        """
        with self._one_call.refusing("update"):
            try:
                return self._update(named_tensors, version, _subset(subset, self.config))
            except BaseException:
                executor = self._connection.executor
                if executor is not None:
                    executor.forget_deltas()  # failed after its writes too: next is full
                raise

    def _update(
        self, named_tensors: NamedTensors, version: str | None, subset: frozenset[str] | None
    ) -> UpdateReport:
        attempt = self._attempt(version, subset)
        self._last_attempt = attempt
        report = attempt.run(named_tensors)
        logger.info("p2pweights update %s", report.summary())
        return report

    def _attempt(self, version: str | None, subset: frozenset[str] | None = None) -> UpdateAttempt:
        return UpdateAttempt(
            self._connection, self._collective, self._cancel, self._rank_name, version, subset
        )

    # -- giving up and teardown ----------------------------------------------------------------

    def abort(self, *, resume_incomplete: bool = False) -> AbortReport:
        """Give up on an update: end open update sessions and resume the engines this
        session paused whose weights are whole.

        Only trainer rank 0 drives the engines; on other ranks this returns an empty
        report. With ``pause_mode="caller"`` it resumes nothing: each engine is left to the
        caller, and one with torn weights is reported "left paused by the caller: ... must
        not be resumed". Called from another thread while ``update()`` runs, it cancels
        that update (which raises ``TransferError``) and waits for it to stop (writes in
        flight are bounded by ``timeouts.transfer``, engine calls by their time limits);
        while ``connect``, ``abort`` or ``close`` runs in another thread it waits for
        that to return.

        Args:
            resume_incomplete: Resume an engine whose writes did not all land too (it then
                serves torn weights, and still shows the ``p2pweights-updating:<version>``
                weight version). By default it stays paused.

        Returns:
            What happened to each engine, including those that could not be reached
            (``AbortReport.ok`` is False where one is left torn or unreachable).

        Raises:
            SessionBusyError: Called on the thread of a running call (from ``update()``'s
                input iterator, a signal handler) instead of waiting forever for itself (a
                running update is still cancelled). Nothing else: failures are reported.
        """
        with self._one_call.waiting("abort"):
            return self._abort(resume_incomplete)

    def _abort(self, resume_incomplete: bool) -> AbortReport:
        report = self._connection.abort(
            drives=self.config.leads, resume_incomplete=resume_incomplete
        )
        if not report.ok:
            logger.warning("p2pweights abort: %s", report)
        return report

    def close(self) -> None:
        """``abort()``, then release connections, writer threads and the transport.

        An update running in another thread is cancelled and waited for first, any other
        call waited for, as ``abort()`` does; a failed abort is logged, not raised.
        ``connect()`` opens the session again.
        """
        with self._one_call.waiting("close"):
            try:
                self._abort(resume_incomplete=False)
            except Exception as exc:  # closing must not hide the error that led here
                logger.warning("p2pweights close: abort failed: %r", exc)
            self._connection.close()

    def __enter__(self) -> WeightSyncSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _subset(subset: Collection[str] | None, config: SyncConfig) -> frozenset[str] | None:
    """``update(subset=...)`` as a set of names, refused where partial updates cannot go."""
    if subset is None:
        return None
    if isinstance(subset, str):
        raise ConfigError("subset= takes a collection of HF names, not one string")
    if config.delta is not None:
        raise ConfigError(
            "a partial update (subset=) cannot go with SyncConfig.delta: deltas compare every "
            "staged byte with the previous update's; use delta=None for partial updates"
        )
    if config.num_pipeline_stages > 1:
        raise ConfigError("a partial update (subset=) is not supported with pipeline stages")
    return frozenset(subset)
