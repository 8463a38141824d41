"""``WeightSyncSession``: connect to engines once, then push every training step's weights.

The session only sequences. What a connection keeps (the engines, this rank's targets,
the replicas, the executor) is ``connection.Connection``; the steps of one update are
``update_attempt.UpdateAttempt``; the engines' update state (``engines``), the rank
assignment and the byte plan (``plan``), the trainer's tensors (``source``) and
staging and writing (``transfer``) live below those.

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

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from p2pweights import logs
from p2pweights.collective import Collective
from p2pweights.config import SyncConfig, TrainerTopology
from p2pweights.connection import Connection
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.update_session import AbortReport
from p2pweights.errors import ConfigError
from p2pweights.one_call import OneCall
from p2pweights.report import UpdateReport
from p2pweights.transfer.staging_device import staging_device_for
from p2pweights.update_attempt import NamedTensors, UpdateAttempt

logger = logging.getLogger(__name__)

__all__ = ["WeightSyncSession"]


class WeightSyncSession:
    """Pushes a trainer's HF-named tensors into connected sglang engines, point to point."""

    def __init__(
        self,
        config: SyncConfig | None = None,
        *,
        topology: TrainerTopology | None = None,
        agree: Callable[[bool], bool] | None = None,
        gather: Callable[[object], list[object]] | None = None,
        staging_device: torch.device | str | None = None,
    ):
        """``topology``: where this process stands among the sending trainer ranks (default:
        the only one); it replaces the deprecated ``SyncConfig`` fields of the same facts.
        ``agree(ok)`` must return whether every sending trainer rank, of every pipeline
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
        """A session for every rank of a ``torch.distributed`` ``group`` (default: all).

        Every rank of ``group`` sends, and each must call this (it runs one all-gather).
        ``pipeline_stage`` / ``num_pipeline_stages`` say which stage this rank holds
        (default: the config's, else one stage, all ranks holding the same weights, e.g.
        FSDP2); this rank's place among its stage's ranks, in group order, makes the
        session's ``TrainerTopology``, and ``agree`` and ``gather`` run over ``group``
        (gloo or NCCL).
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
            self._connection.connect(engines)

    def update(
        self,
        named_tensors: NamedTensors,
        *,
        version: str | None = None,
        subset: Collection[str] | None = None,
    ) -> UpdateReport:
        """Write ``(hf_name, tensor)`` pairs (checkpoint names) into every connected engine.

        ``subset``: a partial update (not the first): the HF names this update sends,
        exactly. Only the parameters they feed are written (and verified); the engines keep
        every other weight as it was. A name outside ``subset``, one of it missing from the
        input, or a parameter group it covers only in part is refused before any byte is
        written. Not with ``SyncConfig.delta`` or pipeline stages.

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

        An engine whose writes did not all land stays paused, its weight version
        saying ``p2pweights-updating:<version>``, unless ``resume_incomplete`` (then it
        serves torn weights, and still shows that version). Returns what happened to
        each engine, including those that could not be reached; it does not raise.
        Only trainer rank 0 drives the engines; on other ranks this returns an empty
        report. With ``pause_mode="caller"`` it resumes nothing: each engine is left to the
        caller, and one with torn weights is reported "left paused by the caller: ... must
        not be resumed" (``AbortReport.ok`` False). Called from another thread while
        ``update()`` runs, it cancels that
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
        report = self._connection.abort(
            drives=self.config.leads, resume_incomplete=resume_incomplete
        )
        if not report.ok:
            logger.warning("p2pweights abort: %s", report)
        return report

    def close(self) -> None:
        """``abort()``, then release connections, writer threads and the transport (an
        update running in another thread is cancelled and waited for first, any other
        call waited for, as ``abort()`` does). ``connect()`` opens the session again."""
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
