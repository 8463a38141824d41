"""A session's connection: the engines it reached and what writing into them keeps.

``Connection`` owns, from one ``connect`` to the next, the connected engines and their
update state (``engines.fleet``), this trainer rank's targets, the replicas (one per
layout, kept for the process), the transfer executor with its staging buffers and
transport connections, the write check, the first update's prepared plan, and the
engines an earlier connect reached that are not connected now (until ``abort``
releases them). ``WeightSyncSession`` sequences calls on it; one update attempt
(``update_attempt``) writes through it.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

import torch

from p2pweights.config import SyncConfig
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectedEngine, ConnectOptions, Fleet
from p2pweights.engines.update_state import AbortReport, EngineUpdate
from p2pweights.errors import ConfigError, TransferError
from p2pweights.plan.byte_plan import BytePlan
from p2pweights.plan.prepare import (
    Prepared,
    check_one_model,
    engine_checkpoints,
    staging_bytes,
)
from p2pweights.plan.targets import Targets, assign, every, moved
from p2pweights.replica.registry import ReplicaHandle, replica_for
from p2pweights.source.expected import ExpectedCheckpoint
from p2pweights.transfer.executor import TransferExecutor
from p2pweights.transports import create_transport
from p2pweights.verification.check import WriteCheck

logger = logging.getLogger(__name__)

__all__ = ["Connection", "not_connected"]


class Connection:
    """The engines one session is connected to, and what this trainer rank keeps to
    write into them."""

    def __init__(self, config: SyncConfig, staging_device: torch.device) -> None:
        self.config = config
        self.staging_device = staging_device
        self.executor: TransferExecutor | None = None
        self.fleet = Fleet([])
        # the engines whose writes are verified after each update's end
        self.write_check = WriteCheck()
        # engines warned about as unverified: once per session (``WriteCheck.warned``)
        self.unverified_warned: set[str] = set()
        self.replicas: dict[Hashable, ReplicaHandle] = {}
        self.targets: Targets = {}
        # the engine ranks assign() gave this rank (``targets`` holds every engine rank
        # once owner sends write owned tensors to all of them: ``write_to_every``)
        self.assigned: Targets = {}
        self.expected: list[tuple[ExpectedCheckpoint, torch.dtype | None]] = []
        # the first update's contract, groups and byte plan (None until it was prepared)
        self.prepared: Prepared | None = None
        self.next_version = 1
        # the engines' weight check passed once; it stays done across connects: it
        # compares the session's first update with the engines' start weights
        self.checked = False
        # engines of an earlier connect not connected now, until abort() releases them
        self.orphans: dict[str, EngineUpdate] = {}

    def connect(self, engines: Sequence[str | EngineEndpoint]) -> None:
        """Read every engine afresh and plan this rank's targets (``WeightSyncSession.connect``
        says what is refused); a failure leaves it unconnected."""
        if not engines:
            raise ConfigError("connect() needs at least one engine URL")
        endpoints = sorted((EngineEndpoint.of(e) for e in engines), key=lambda e: e.url)
        if len({e.url for e in endpoints}) != len(endpoints):
            raise ConfigError("each engine may be listed once")
        # engines of the last connection: their update state (paused by us? torn?) is kept
        # for a reconnect to the same URL, and abort()/close() still reach the others
        self.orphans.update({e.url: e.update for e in self.fleet.engines})
        self.fleet.engines = []
        self.disconnect()
        config = self.config
        try:
            fleet = Fleet.connect(
                endpoints,
                ConnectOptions(
                    config.transport.kind,
                    config.timeouts.read,
                    config.timeouts.control,
                    config.api_key,
                    config.allow_sglang_mismatch,
                    end_update_timeout_s=config.timeouts.end_update_bound,
                ),
            )
        except BaseException:
            if self.executor is not None:
                self.executor.disconnect()
            raise
        try:
            targets, write_check = self._plan(fleet)
        except BaseException:
            fleet.close_clients()
            if self.executor is not None:
                self.executor.disconnect()
            raise
        for engine in fleet.engines:
            before = self.orphans.pop(engine.url, None)
            if before is not None:
                engine.update.take_over(before)
                before.client.close()
        self.fleet, self.targets, self.write_check = fleet, targets, write_check
        self.assigned = targets
        self.expected = engine_checkpoints(fleet.engines)
        self.next_version = max(self.next_version, fleet.next_numeric_version())
        logger.info(
            "connected to %d engine(s); trainer rank %d writes %d engine rank(s), %d replica(s)",
            len(fleet.engines),
            config.trainer_rank,
            sum(len(pubs) for pubs in targets.values()),
            len(targets),
        )

    def _plan(self, fleet: Fleet) -> tuple[Targets, WriteCheck]:
        """This rank's targets among the connected engines, connected and with staging
        reserved, and the write check over them."""
        config = self.config
        check_one_model(fleet.engines)
        write_check = WriteCheck.for_config(config, fleet.engines, self.unverified_warned)
        if self.executor is None:
            transport = create_transport(config.transport)
            self.executor = TransferExecutor(
                transport, self.staging_device, config.timeouts.transfer, config.delta
            )
        targets = assign(fleet.engines, config.num_trainer_ranks, config.trainer_rank, self.replica)
        self.executor.connect([pub for pubs in targets.values() for pub in pubs])
        if targets:  # an idle trainer rank stages nothing (connect dropped the old targets)
            replicas = [self.replicas[key] for key in targets]
            self.executor.reserve(staging_bytes(replicas, config.buffer_bytes))
        return targets, write_check

    def replica(self, engine: ConnectedEngine, rank: int, role: str = "target") -> ReplicaHandle:
        """The replica of an engine rank's layout: one per layout, kept for the process."""
        handle = replica_for(engine.server_info, rank, engine.endpoint.model_path, role)
        return self.replicas.setdefault(handle.key, handle)

    def write_to_every(self) -> None:
        """Owner sends: connect every engine rank (owned tensors go to all of them) and
        reserve staging for every layout; ``assigned`` keeps this rank's own share."""
        assert self.executor is not None
        targets = every(self.fleet.engines, self.replica)
        self.executor.connect([pub for pubs in targets.values() for pub in pubs])
        replicas = [self.replicas[key] for key in targets]
        self.executor.reserve(staging_bytes(replicas, self.config.buffer_bytes))
        self.targets = targets

    def ready(self) -> tuple[TransferExecutor, Prepared]:
        """The executor and the prepared update an update's steps work with."""
        if self.executor is None or self.prepared is None:  # only a bug gets here now
            raise not_connected()
        return self.executor, self.prepared

    def refresh_targets(self) -> BytePlan | None:
        """Where a live publication moved (the engine gave parameters new storage when
        its session opened): connect and plan into the new addresses; the new plan, or
        None if nothing moved. Connected and planned first, then kept: a failure here
        leaves the old targets, so the next update sees the move again and retries it."""
        executor, prepared = self.ready()
        targets = moved(self.targets, self.fleet.engines, self.replicas)
        if targets is None:
            return None
        executor.connect([pub for pubs in targets.values() for pub in pubs])
        plan = prepared.replan(self.replicas, targets, self.config.buffer_bytes)
        self.targets, prepared.plan = targets, plan
        return plan

    def abort(self, *, drives: bool, resume_incomplete: bool) -> AbortReport:
        """Settle the writes, then (on the rank that ``drives`` the engines) end open
        sessions and resume engines, of this connection and of earlier ones."""
        report = AbortReport()
        if self.executor is not None:
            try:
                self.executor.settle()  # a failed update's writes must not land after this
            except TransferError as exc:
                logger.warning("abort: %s", exc)
        if drives and self.fleet.engines:
            report = self.fleet.abort(resume_incomplete)
        if drives:
            for url, orphan in self.orphans.items():  # engines an earlier connect reached
                try:
                    report.outcomes[url] = orphan.abort(resume_incomplete)
                except Exception as exc:  # abort reports, it does not raise
                    report.outcomes[url] = f"unreachable: {exc}"
                orphan.client.close()
            self.orphans = {}
        return report

    def disconnect(self) -> None:
        """Forget the engines and the plan. The executor keeps its buffers and, until the
        next ``connect`` replaces them (or ``close`` drops them), its connections."""
        self.fleet.close_clients()
        self.targets, self.prepared, self.write_check = {}, None, WriteCheck()
        self.assigned = {}

    def close(self) -> None:
        """``disconnect``, then release writer threads, buffers and the transport."""
        self.disconnect()
        if self.executor is None:
            return
        transport = self.executor.transport
        self.executor.close()
        in_flight = sorted(self.executor.unsettled_targets)
        if in_flight:  # a later session cannot know: say it here
            logger.warning(
                "p2pweights close: writes to %s may still land; they stay torn (left "
                "paused), and a new session must not write them before those ended",
                ", ".join(f"{url} rank {rank}" for url, rank in in_flight),
            )
        transport.close()
        self.executor = None


def not_connected() -> ConfigError:
    return ConfigError("call connect(engines) before update() (or again, after close())")
