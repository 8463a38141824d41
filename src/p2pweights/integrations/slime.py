"""p2pweights as slime's full-weight updater, with slime pausing and resuming the engines.

Read from THUDM/slime at ``624b824a8`` (2026-08-21). ``MegatronTrainRayActor.init``
(``slime/backends/megatron_utils/actor.py``) picks the updater class from
``--update-weight-mode`` / ``--update-weight-transport``; for the defaults (``full`` +
``nccl``, not ``--colocate``) it is the module global ``UpdateWeightFromDistributed``.
``--custom-megatron-init-path`` runs inside ``init(args)``, before that choice, so
``install`` can rebind the global, as for miles before its protocol.

``P2PWeightsSlimeUpdater`` subclasses slime's own ``UpdateWeightFromDistributed`` and
keeps its ``update_weights``: slime's rank 0 pauses and flushes every engine, every rank
runs ``_send_weights`` (TP gathers and HF conversion; the chunks land on each pipeline
stage's source rank, DP = TP = 0), and rank 0 resumes the engines. Only the transport
changes: ``_send_weights`` runs one ``WeightSyncSession.update`` with
``pause_mode="caller"`` (it marks, flushes, begins, writes, checks, sets the version
``str(weight_version)`` and ends each engine, never pausing or resuming it) and slime's
``_update_bucket_weights_from_distributed`` hands each chunk to it instead of NCCL. The
source ranks, one per stage, are the sender group (``pipeline_stage`` = the stage).

Flags::

    --update-weight-mode full --update-weight-transport nccl     # slime's defaults
    --custom-megatron-init-path p2pweights.integrations.slime.install

``install(args, config=SyncConfig(...))`` from an init function of your own sets the
transport and the rest (``pause_mode`` is always ``caller``: slime pauses).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from p2pweights.config import SyncConfig
from p2pweights.errors import ConfigError
from p2pweights.integrations import FrameworkMismatchError
from p2pweights.integrations.miles_args import missing_module, update_metrics
from p2pweights.integrations.streamed_update import StreamedUpdate
from p2pweights.sync_session import WeightSyncSession

logger = logging.getLogger(__name__)

__all__ = ["SLIME_COMMIT", "install", "updater_class"]

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
"""The slime commit this module was written against."""
_ACTOR = "slime.backends.megatron_utils.actor"
_DISTRIBUTED = "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"


def install(args: Any = None, *, config: SyncConfig | None = None) -> type:
    """Make slime's ``full`` + ``nccl`` updater write with p2pweights.

    For ``--custom-megatron-init-path p2pweights.integrations.slime.install`` (slime calls
    it with its args on every trainer rank, before it builds the updater), or from your
    own init function with a ``config``. Returns the class installed."""
    if args is not None:
        mode, transport = args.update_weight_mode, args.update_weight_transport
        if mode != "full" or transport != "nccl" or getattr(args, "colocate", False):
            raise ConfigError(
                "p2pweights replaces slime's UpdateWeightFromDistributed, chosen for "
                "--update-weight-mode full --update-weight-transport nccl without --colocate; "
                f"got {mode!r} / {transport!r}"
                + (" with --colocate" if getattr(args, "colocate", False) else "")
            )
    cls = updater_class(config)
    actor: Any = _import(_ACTOR)
    actor.UpdateWeightFromDistributed = cls
    logger.info("slime's full-weight updater now writes with p2pweights (%s)", cls.__qualname__)
    return cls


def updater_class(config: SyncConfig | None = None) -> type:
    """``P2PWeightsSlimeUpdater``: a subclass of the installed slime's
    ``UpdateWeightFromDistributed`` (made when asked, so importing this module needs no
    slime)."""
    base: Any = _import(_DISTRIBUTED).UpdateWeightFromDistributed

    class P2PWeightsSlimeUpdater(base):
        """slime's updater, its transport replaced by one p2pweights update per sync."""

        sync_config: ClassVar[SyncConfig | None] = config

        def __init__(self, args: Any, model: Any, weights_getter: Any = None, **kwargs: Any):
            super().__init__(args, model, weights_getter, **kwargs)
            self._session: WeightSyncSession | None = None
            self._grouped = False
            self._stream: StreamedUpdate | None = None
            self._urls: list[str] = []

        def connect_rollout_engines(
            self, rollout_engines: Sequence[Any], rollout_engine_lock: Any, **kwargs: Any
        ) -> None:
            """Every rank: the session over the stages' source ranks (made once, on every
            rank, as ``new_group`` must be), connected on the source ranks to each
            engine's ``get_url()`` (``None`` on nodes other than 0)."""
            import ray
            import torch.distributed as dist

            self.rollout_engines = rollout_engines
            self.rollout_engine_lock = rollout_engine_lock
            if not self._grouped:  # collectives: once, on every rank alike
                stage, num_stages, source = _parallel_state()
                # what slime's own connect sets, and its _send_weights reads
                self._is_pp_src_rank = source
                self._group_name = f"p2pweights-pp_{stage}"
                group = dist.new_group(ranks=_source_ranks(source), backend="gloo")
                self._grouped = True
                if source:
                    self._session = WeightSyncSession.from_torch_distributed(
                        _caller_config(self.sync_config, args_buffer(self.args)),
                        group=group,
                        pipeline_stage=stage,
                        num_pipeline_stages=num_stages,
                    )
            if self._session is None:  # not a source rank: it only gathers
                return
            urls = ray.get([engine.get_url.remote() for engine in rollout_engines])
            self._urls = [str(url) for url in urls if url is not None]
            self._session.connect(self._urls)

        def disconnect_rollout_engines(self) -> None:
            """Nothing: the next ``connect_rollout_engines`` connects afresh."""

        def _send_weights(self, pbar: Any) -> None:
            """slime's own gathers and conversion on every rank; on a source rank their
            chunks go into one p2pweights update (slime paused the engines already)."""
            if self._session is not None:
                self._stream = StreamedUpdate(
                    self._session, version=str(self.weight_version), name="p2pweights-slime"
                )
            try:
                super()._send_weights(pbar)
            except BaseException as exc:
                stream, self._stream = self._stream, None
                if stream is not None and self._session is not None and stream.running:
                    stream.cancel(exc, wait_s=self._session.config.timeouts.transfer)
                raise
            stream, self._stream = self._stream, None
            if stream is not None:
                self.update_weight_metrics = update_metrics(stream.finish())

        def _update_bucket_weights_from_distributed(
            self, converted_named_tensors: Any, pbar: Any = None, load_format: Any = None
        ) -> None:
            if self._stream is None:
                raise ConfigError("a weight chunk came outside update_weights()")
            self._stream.send(converted_named_tensors)
            if pbar is not None:
                pbar.update(1)

    return P2PWeightsSlimeUpdater


def _import(module: str) -> Any:
    """One of slime's modules; ``FrameworkMismatchError`` saying what is missing where slime
    (or the module) is not there. A module that is there but fails on an import of its own
    raises that error."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if not missing_module(exc, module):
            raise
        what = (
            "slime is not installed"
            if missing_module(exc, "slime")
            else f"the installed slime has no {exc.name}"
        )
        raise FrameworkMismatchError(
            f"{what} (p2pweights.integrations.slime needs {module}, as in THUDM/slime "
            f"{SLIME_COMMIT[:9]}); install slime in this environment (pip install -e "
            "<slime checkout>), or use p2pweights.integrations.miles for miles"
        ) from exc


def args_buffer(args: Any) -> int:
    """slime's ``--update-weight-buffer-size``, at least p2pweights' 1 MiB floor."""
    return max(int(args.update_weight_buffer_size), 1 << 20)


def _caller_config(config: SyncConfig | None, buffer_bytes: int) -> SyncConfig:
    """The session's config: ``pause_mode="caller"`` (slime pauses); any other pause mode
    set is refused."""
    given = config or SyncConfig(buffer_bytes=buffer_bytes)
    if "pause_mode" in given.model_fields_set and given.pause_mode != "caller":
        raise ConfigError(
            f"pause_mode={given.pause_mode} cannot apply: slime's updater pauses and resumes "
            "the engines itself (leave pause_mode unset)"
        )
    return given.model_copy(update={"pause_mode": "caller"})


def _parallel_state() -> tuple[int, int, bool]:
    """(this rank's pipeline stage, the number of stages, whether it is its stage's source:
    DP = TP = 0, slime's ``_is_pp_src_rank``), from Megatron's ``mpu``."""
    from megatron.core import mpu

    source = (
        mpu.get_data_parallel_rank(with_context_parallel=True) == 0
        and mpu.get_tensor_model_parallel_rank() == 0
    )
    return (
        mpu.get_pipeline_model_parallel_rank(),
        mpu.get_pipeline_model_parallel_world_size(),
        source,
    )


def _source_ranks(source: bool) -> list[int]:
    """The global ranks of every stage's source rank, in stage order (all ranks take part)."""
    import torch.distributed as dist

    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, source)
    return [rank for rank, is_source in enumerate(flags) if is_source]
