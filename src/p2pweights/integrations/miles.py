"""p2pweights as miles' weight updater: ``--update-weight-transfer-mode p2p`` through p2pweights.

Read from radixark/miles at ``31f1ca961`` (2026-08-21). miles has no pluggable
weight-transfer protocol there: ``MegatronTrainRayActor.init``
(``miles/backends/megatron_utils/actor.py``) picks ``update_weight_cls`` from
``--update-weight-transfer-mode`` (``broadcast``, ``disk-delta``, else the module's
``UpdateWeightP2P``), and no flag names a class by path. Every updater but the colocated
one derives from ``DistBucketedWeightUpdateMixin``, whose ``update_weights`` drives one
update through hooks: ``_pause_and_prepare_engines`` (rank 0 pauses, flushes and begins
the engines' update session), then on every rank the bucketed TP / EP gathers and HF
conversion, handing each bucket of (HF name, tensor) pairs to
``_update_weight_implementation`` on the ranks where ``_is_source``, then
``_finalize_and_resume_engines`` (rank 0 sets the version, ends the session, resumes).

``P2PWeightsUpdater`` is such a class. Every rank of a pipeline stage holds the stage's
gathered weights, so every rank is a source, and the ranks of a stage are one p2pweights
sender group (``SyncConfig.pipeline_stage`` from miles' parallel state): they split the
engine ranks, each writing only its stage's parameters. The hooks become one
``WeightSyncSession.update``: it starts in ``_pause_and_prepare_engines``, each bucket
streams into it (``StreamedUpdate``), and ``_finalize_and_resume_engines`` waits for it
and records its ``UpdateReport`` for ``pop_metrics``. p2pweights owns the engines' update
session (pause, begin, end, version, resume; stage 0's rank 0): miles' own calls to them
are replaced, since the session cannot yet leave them to miles.

``install`` is the one step miles needs, run through an existing flag::

    --update-weight-transfer-mode p2p
    --custom-megatron-init-path p2pweights.integrations.miles.install

miles calls ``install(args)`` on every trainer rank before it picks the updater class;
``install`` rebinds ``UpdateWeightP2P`` in miles' actor module to ``P2PWeightsUpdater``.
``install(args, config=SyncConfig(...))``, from an init function of your own, sets
what miles' flags do not (the transport; fields left unset come from the flags).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from p2pweights.config import SyncConfig
from p2pweights.errors import ConfigError
from p2pweights.integrations import FrameworkMismatchError
from p2pweights.integrations.miles_args import (
    config_from_args,
    missing_module,
    transport_from_args,
    update_metrics,
)
from p2pweights.integrations.streamed_update import StreamedUpdate
from p2pweights.sync_session import WeightSyncSession

logger = logging.getLogger(__name__)

__all__ = [
    "P2PWeightsUpdater",
    "config_from_args",
    "engine_urls",
    "install",
    "installed_miles",
    "miles_seam",
    "missing_module",
    "transport_from_args",
    "update_metrics",
]

MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"
"""The miles commit this module was written against."""
_MIXIN = "miles.backends.megatron_utils.update_weight.update_weight_from_distributed.mixin"
_ACTOR = "miles.backends.megatron_utils.actor"
_PARALLEL = "miles.backends.training_utils.parallel"
_PROTOCOL = "miles.backends.training_utils.weight_update.protocol"
_UPDATER = "miles.backends.training_utils.weight_update.updater"


def _miles_base() -> type:
    """miles' ``DistBucketedWeightUpdateMixin``; p2pweights' stand-in where miles has none
    (no miles, or a miles after the protocol, which ``install`` routes elsewhere)."""
    try:
        return cast(type, importlib.import_module(_MIXIN).DistBucketedWeightUpdateMixin)
    except ModuleNotFoundError as exc:
        if not missing_module(exc, _MIXIN):
            raise  # miles has the mixin but it does not import: say why, do not hide it
    from p2pweights.integrations._miles_stand_in import DistBucketedWeightUpdateMixin

    return DistBucketedWeightUpdateMixin


if TYPE_CHECKING:
    from p2pweights.integrations._miles_stand_in import DistBucketedWeightUpdateMixin as _Base
else:
    _Base = _miles_base()


class P2PWeightsUpdater(_Base):
    """miles' weight updater writing through a ``WeightSyncSession`` (one per trainer rank).

    Built by miles as ``cls(args, model, weights_getter=..., model_name=...,
    quantization_config=..., is_lora=...)`` on every trainer rank. ``session`` is for
    tests; by default the session is made over all ranks (its own gloo group: it runs
    its collectives on the update's worker thread), one sender group per pipeline stage.
    """

    sync_config: ClassVar[SyncConfig | None] = None
    """What ``install(args, config=...)`` was given; fields it leaves unset come from args."""

    def __init__(
        self,
        args: Any,
        model: Sequence[torch.nn.Module],
        weights_getter: Any = None,
        *,
        model_name: str,
        quantization_config: dict | None,
        is_lora: bool = False,
        session: WeightSyncSession | None = None,
    ):
        if is_lora:
            raise ConfigError(
                "p2pweights writes full weights, not LoRA adapters; use "
                "--update-weight-transfer-mode broadcast for LoRA runs"
            )
        self.args = args
        self.model = model
        self.model_name = model_name
        self.quantization_config = quantization_config
        self.weight_version = 0
        self.rollout_engines: Sequence[Any] | None = None
        self.rollout_engine_lock: Any = None
        self._connection_stale = False
        self._init_lora(
            args=args,
            model=model,
            model_name=model_name,
            quantization_config=quantization_config,
            is_lora=False,
        )
        if session is None:
            stage, num_stages = _pipeline()
            session = _session(config_from_args(args, self.sync_config, stage, num_stages))
        self.session = session
        self._group_name = f"p2pweights-pp_{session.config.pipeline_stage}"
        self._stream: StreamedUpdate | None = None

    # -- what miles' actor calls ----------------------------------------------------------------

    def connect_rollout_engines(
        self,
        rollout_engines: Sequence[Any],
        rollout_engine_lock: Any,
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
    ) -> None:
        """Connect the session to the engines' servers (their URLs from the engine
        actors). The GPU counts and offsets are unused: each engine says its layout.
        The lock serializes miles' NCCL broadcasts; p2pweights needs none."""
        self.session.connect(engine_urls(rollout_engines))
        self.rollout_engines = rollout_engines
        self.rollout_engine_lock = rollout_engine_lock
        self._connection_stale = False

    def is_rollout_engines_fresh(self) -> bool:
        return self.rollout_engines is not None and not self._connection_stale

    def mark_engine_connection_stale(self) -> None:
        self._connection_stale = True

    def update_weights(self) -> None:
        """miles' update (its mixin's ``update_weights``); if miles' own code fails midway,
        the running p2pweights update is told the trainer stopped sending, so it fails too."""
        try:
            super().update_weights()
        except BaseException as exc:
            stream, self._stream = self._stream, None
            if stream is not None and stream.running:
                config = self.session.config
                stream.cancel(exc, wait_s=config.timeouts.control + config.timeouts.transfer)
            raise

    # -- the mixin's hooks ----------------------------------------------------------------------

    @property
    def _is_source(self) -> bool:
        """Every rank: the ranks of a stage split the engine ranks among themselves."""
        return True

    @property
    def _is_lora_source(self) -> bool:
        return False

    def _pause_and_prepare_engines(self) -> None:
        """Start the update (p2pweights pauses and opens the engines, once it has what
        it needs to write: miles must not)."""
        if self.rollout_engines is None:
            raise ConfigError("connect_rollout_engines() must come before update_weights()")
        self._stream = StreamedUpdate(
            self.session, version=str(self.weight_version), name=f"{self._group_name}-update"
        )

    def _update_weight_implementation(
        self, converted_named_tensors: list[tuple[str, torch.Tensor]], pbar: Any = None
    ) -> None:
        """One bucket into the running update; returns once the update took it."""
        if self._stream is None:
            raise ConfigError("a weight bucket came outside update_weights()")
        self._stream.send(converted_named_tensors)
        if pbar is not None:
            pbar.update(1)

    def _finalize_and_resume_engines(self) -> None:
        """Wait for the update (p2pweights closes, versions and resumes the engines)."""
        stream, self._stream = self._stream, None
        if stream is None:
            raise ConfigError("no update is running to finish")
        report = stream.finish()
        self.update_weight_metrics = update_metrics(report)


def engine_urls(rollout_engines: Sequence[Any]) -> list[str]:
    """The servers of miles' engine actors (``SGLangEngine.get_topology_info()["url"]``)."""
    import ray

    infos = ray.get([engine.get_topology_info.remote() for engine in rollout_engines])
    return [info["url"] for info in infos]


def install(args: Any = None, *, config: SyncConfig | None = None) -> type:
    """Make miles' ``--update-weight-transfer-mode p2p`` write with p2pweights.

    For ``--custom-megatron-init-path p2pweights.integrations.miles.install`` (miles
    calls it with its args on every trainer rank, before it builds the updater), or
    from your own init function with a ``config``. Picks the seam the installed miles
    has: its ``WeightTransferProtocol`` (miles after PR 2752: ``p2p`` then builds
    ``P2PWeightsProtocol``) or, before it, the updater class (``UpdateWeightP2P``
    becomes ``P2PWeightsUpdater``). Returns the class installed; raises
    ``FrameworkMismatchError`` naming the installed miles when it has neither.
    """
    if args is not None and args.update_weight_transfer_mode != "p2p":
        raise ConfigError(
            f"p2pweights replaces miles' p2p updater, but --update-weight-transfer-mode is "
            f"{args.update_weight_transfer_mode!r}; add --update-weight-transfer-mode p2p"
        )
    if miles_seam() == "protocol":
        from p2pweights.integrations.miles_protocol import install_protocol

        return install_protocol(config)
    actor: Any = importlib.import_module(_ACTOR)
    cls = P2PWeightsUpdater
    if config is not None:
        cls = cast(
            "type[P2PWeightsUpdater]",
            type("P2PWeightsUpdater", (P2PWeightsUpdater,), {"sync_config": config}),
        )
    actor.UpdateWeightP2P = cls
    logger.info("miles' p2p weight transfer now writes with p2pweights (%s)", cls.__qualname__)
    return cls


def miles_seam() -> str:
    """Which seam the installed miles has: ``"protocol"`` (``WeightTransferProtocol``,
    miles after PR 2752) or ``"mixin"`` (the updater class, miles before it). Raises
    ``FrameworkMismatchError`` naming the installed miles when it has neither."""
    if _has(_PROTOCOL, "WeightTransferProtocol") and _has(_UPDATER, "get_weight_transfer_protocol"):
        return "protocol"
    if _has(_MIXIN, "DistBucketedWeightUpdateMixin") and _has(_ACTOR, "UpdateWeightP2P"):
        return "mixin"
    raise FrameworkMismatchError(
        f"p2pweights cannot plug into the installed miles ({installed_miles()}): it has "
        f"neither {_PROTOCOL}.WeightTransferProtocol with {_UPDATER}.get_weight_transfer_protocol "
        f"(miles after PR 2752) nor {_MIXIN}.DistBucketedWeightUpdateMixin with "
        f"{_ACTOR}.UpdateWeightP2P (miles up to {MILES_COMMIT[:9]}). Nothing was installed; "
        "run a miles with one of them, or miles' own --update-weight-transfer-mode"
    )


def installed_miles() -> str:
    """The installed miles in words: its version where pip knows it, and where it is."""
    from importlib import metadata

    try:
        module = importlib.import_module("miles")
    except ModuleNotFoundError:
        return "miles is not importable"
    try:
        version = f"miles {metadata.version('miles')}"
    except metadata.PackageNotFoundError:
        version = "miles of unknown version"
    where = getattr(module, "__file__", None) or list(getattr(module, "__path__", []))
    return f"{version} at {where or 'an unknown place'}"


def _has(module: str, attribute: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as exc:
        if missing_module(exc, module):
            return False
        raise


def _pipeline() -> tuple[int, int]:
    """(this rank's pipeline stage, the number of stages), from miles' parallel state."""
    pp = importlib.import_module(_PARALLEL).get_parallel_state().pp
    return pp.rank, pp.size


def _session(config: SyncConfig) -> WeightSyncSession:
    """A session over every trainer rank, with its own gloo group: its collectives run on
    the update's worker thread, beside miles' on the trainer's."""
    import torch.distributed as dist

    return WeightSyncSession.from_torch_distributed(config, group=dist.new_group(backend="gloo"))
