"""p2pweights as a miles ``WeightTransferProtocol`` (miles after PR 2752).

miles' ``WeightUpdater`` (``miles/backends/training_utils/weight_update/updater.py``)
builds its transport with ``get_weight_transfer_protocol(args)`` and drives it, on
every trainer rank, in this order: ``connect(...)`` (must set ``is_sender``), then per
update ``begin_sync(version, iter_buckets)``; on rank 0 the engines' session frame
(pause, flush, begin) when ``use_weight_update_session``; ``send_bucket(bucket)`` on
sender ranks; ``after_base_weights()``; a gloo barrier; ``finalize(version)``; on rank 0
end, version and resume; a barrier; ``after_engines_resumed()``.

``P2PWeightsProtocol`` runs one ``WeightSyncSession.update`` per miles update and owns
the engines' session frame itself (``use_weight_update_session = False``: miles calls
none of pause / begin / end / version / resume): ``begin_sync`` starts the update on a
worker thread, each ``send_bucket`` streams into it, ``finalize`` waits for it. The
sending ranks of a pipeline stage are one p2pweights sender group: the first
``sum(engine_gpu_counts)`` ranks of the stage (miles' own p2p rule,
``gathered_dp_rank < rollout_num_gpus``); the others do not convert or send.

miles' seam moves: some variants pass ``engine_cell_ids`` to ``connect`` before the
parallel state (radixark ``0274e4f``) or a ``rollout_id`` to ``begin_sync`` (radixark
``523810282c``); both are taken. radixark ``78669cf9`` loads the factory through
``resolve_external_protocol_target`` (``--update-weight-transfer-mode external``), which
calls it as ``build_protocol(args)`` like the others.

miles loads it by path: ``build_protocol`` is the factory for
``--custom-weight-transfer-protocol-path`` (with ``--update-weight-transfer-mode
external`` where miles has that mode). ``protocol_factory(config)`` makes a factory with
a ``SyncConfig`` of your own.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from p2pweights.config import SyncConfig
from p2pweights.errors import ConfigError
from p2pweights.integrations.miles_args import config_from_args, missing_module, update_metrics
from p2pweights.integrations.streamed_update import StreamedUpdate
from p2pweights.sync_session import WeightSyncSession

logger = logging.getLogger(__name__)

__all__ = [
    "ConnectArguments",
    "P2PWeightsProtocol",
    "build_protocol",
    "connect_arguments",
    "engine_urls",
    "install_protocol",
    "protocol_factory",
    "sender_ranks",
]

PROTOCOL_MODULE = "miles.backends.training_utils.weight_update.protocol"
UPDATER_MODULE = "miles.backends.training_utils.weight_update.updater"
FACTORY_PATH = f"{__name__}.build_protocol"
"""What ``--custom-weight-transfer-protocol-path`` must say."""

Bucket = list[tuple[str, torch.Tensor]]


def _protocol_base() -> type:
    """miles' ``WeightTransferProtocol``; p2pweights' stand-in where miles has none."""
    try:
        return cast(type, importlib.import_module(PROTOCOL_MODULE).WeightTransferProtocol)
    except ModuleNotFoundError as exc:
        if not missing_module(exc, PROTOCOL_MODULE):
            raise  # miles has the module but it does not import: say why
    from p2pweights.integrations._miles_stand_in import WeightTransferProtocol

    return WeightTransferProtocol


if TYPE_CHECKING:
    from p2pweights.integrations._miles_stand_in import WeightTransferProtocol as _Base
else:
    _Base = _protocol_base()


def sender_ranks(stages: Sequence[int], num_engine_ranks: int | None) -> list[int]:
    """The trainer ranks that send: in each pipeline stage, its first
    ``num_engine_ranks`` ranks (in rank order), all of them when it is None.

    ``stages[rank]`` is each rank's pipeline stage. A rank past the number of engine
    ranks would be given no engine rank to write, yet convert every bucket."""
    seen: dict[int, int] = {}
    senders = []
    for rank, stage in enumerate(stages):
        index = seen.get(stage, 0)
        seen[stage] = index + 1
        if num_engine_ranks is None or index < num_engine_ranks:
            senders.append(rank)
    return senders


class P2PWeightsProtocol(_Base):
    """miles' transport writing through a ``WeightSyncSession`` (one per sending rank).

    Built by miles as ``cls(args)`` on every trainer rank (through ``build_protocol``).
    ``sync_config``: fields set there win over miles' flags (``protocol_factory``).
    """

    supports_lora: ClassVar[bool] = False
    use_weight_update_session: ClassVar[bool] = False
    """p2pweights pauses, opens, closes, versions and resumes the engines itself."""
    sync_config: ClassVar[SyncConfig | None] = None

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.group_name = "p2pweights"
        self.session: WeightSyncSession | None = None
        # A gloo group over every trainer rank, for the stage all-gather at connect.
        self._all_ranks: Any = None
        self._senders: list[int] | None = None
        self._stream: StreamedUpdate | None = None
        self.engine_cell_ids: Sequence[str] | None = None
        """What miles passed as ``engine_cell_ids`` (radixark ``0274e4f``), kept, unused."""

    # -- connect --------------------------------------------------------------------------------

    def connect(
        self,
        rollout_engines: Sequence[Any],
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Every trainer rank: choose the senders, connect their sessions to the engines'
        servers (``SGLangApiClient.server_url``). Refuses a selector other than "all".

        Then ``parallel_state, placement, selector`` (miles after PR 2752), or
        ``engine_cell_ids, parallel_state, placement, selector`` (radixark ``0274e4f``),
        positionally or by name (``connect_arguments``)."""
        seam = connect_arguments(args, kwargs)
        parallel_state, placement, selector = seam.parallel_state, seam.placement, seam.selector
        if selector != "all":
            raise ConfigError(
                f"miles asks to update only the {selector!r} weights of the engines "
                "(weight_update_selector; a speculative draft that is a separate model). "
                "p2pweights updates every runner an engine has (the target and a same-model "
                "EAGLE / MTP draft) and refuses engines whose draft is a separate model; use "
                "miles' own --update-weight-transfer-mode for such engines"
            )
        import torch.distributed as dist

        if getattr(placement, "gather_pp", False):
            stage, num_stages = 0, 1  # every rank holds every stage's weights
        else:
            stage, num_stages = parallel_state.pp.rank, parallel_state.pp.size
        if self._all_ranks is None:
            self._all_ranks = dist.new_group(backend="gloo")
        stages: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(stages, stage, group=self._all_ranks)
        num_engine_ranks = sum(engine_gpu_counts) if engine_gpu_counts else None
        senders = sender_ranks(stages, num_engine_ranks)
        if senders != self._senders:
            self._regroup(senders, stage, num_stages)
        self.rollout_engines = rollout_engines
        self.engine_cell_ids = seam.engine_cell_ids
        self.is_sender = dist.get_rank() in senders
        if self.session is not None:
            self.session.connect(engine_urls(rollout_engines))

    def _regroup(self, senders: list[int], stage: int, num_stages: int) -> None:
        """A new sender group (every rank makes it, as torch requires)."""
        import torch.distributed as dist

        self.close()
        group = dist.new_group(ranks=senders, backend="gloo")
        self._senders = senders
        if dist.get_rank() in senders:
            config = config_from_args(self.args, self.sync_config, stage, num_stages)
            self.session = WeightSyncSession.from_torch_distributed(config, group=group)
        logger.info(
            "p2pweights: %d of %d trainer ranks send (pipeline stage %d of %d)",
            len(senders),
            dist.get_world_size(),
            stage,
            num_stages,
        )

    # -- one update -----------------------------------------------------------------------------

    def begin_sync(
        self,
        weight_version: int,
        iter_buckets: Callable[..., Iterator[Bucket]],
        rollout_id: int | None = None,
    ) -> bool:
        """Start the update on sending ranks (p2pweights pauses the engines once it has
        what it needs to write). An update miles left unfinished is cancelled first.
        ``rollout_id`` (passed by some miles, e.g. radixark ``523810282c``) is not used:
        the engines show ``weight_version``."""
        self._cancel_unfinished()
        if self.session is not None:
            self._stream = StreamedUpdate(
                self.session, version=str(weight_version), name="p2pweights-miles-update"
            )
        return True

    def send_bucket(self, bucket: Bucket) -> None:
        """One bucket into the running update; returns once the update took it."""
        if self._stream is None:
            raise ConfigError(
                "a weight bucket came outside an update (begin_sync first) or to a rank "
                "that does not send (is_sender is False)"
            )
        self._stream.send(bucket)

    def finalize(self, weight_version: int) -> None:
        """Wait for the update: the engines are written, closed, versioned and resumed
        when it returns; raises the update's error on every sending rank."""
        stream, self._stream = self._stream, None
        if stream is None:
            return  # not a sending rank
        self.update_weight_metrics = update_metrics(stream.finish())

    def close(self) -> None:
        """End any update left running and release the session."""
        self._cancel_unfinished()
        if self.session is not None:
            self.session.close()
            self.session = None

    def _cancel_unfinished(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None and stream.running and self.session is not None:
            config = self.session.config
            reason = ConfigError("miles began a new update before finishing the last one")
            stream.cancel(reason, wait_s=config.timeouts.control + config.timeouts.transfer)


@dataclass(frozen=True)
class ConnectArguments:
    """What miles' ``connect`` passes after the engines and their GPU counts and offsets."""

    parallel_state: Any
    placement: Any
    selector: str
    engine_cell_ids: Sequence[str] | None = None


_CONNECT_NAMES = ("parallel_state", "placement", "selector")
_CONNECT_WITH_CELLS = ("engine_cell_ids", *_CONNECT_NAMES)


def connect_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> ConnectArguments:
    """``connect``'s arguments after the engine offsets, for either of miles' seams: four
    positional ones start with ``engine_cell_ids`` (radixark ``0274e4f``), three do not;
    any of them may come by name. Raises ``TypeError`` naming an argument it does not
    know or one that is missing, as Python would."""
    names = _CONNECT_WITH_CELLS if len(args) == len(_CONNECT_WITH_CELLS) else _CONNECT_NAMES
    if len(args) > len(names):
        raise TypeError(f"connect() takes at most 7 arguments after self, got {3 + len(args)}")
    given = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        if name not in _CONNECT_WITH_CELLS:
            raise TypeError(f"connect() got an unexpected argument {name!r}")
        if name in given:
            raise TypeError(f"connect() got multiple values for argument {name!r}")
        given[name] = value
    missing = [name for name in _CONNECT_NAMES if name not in given]
    if missing:
        raise TypeError(f"connect() is missing {', '.join(missing)}")
    return ConnectArguments(**given)


def engine_urls(rollout_engines: Sequence[Any]) -> list[str]:
    """The servers of miles' engine clients (``SGLangApiClient.server_url``)."""
    urls = []
    for engine in rollout_engines:
        url = getattr(engine, "server_url", None)
        if not isinstance(url, str):
            raise ConfigError(
                f"miles handed p2pweights an engine without a server_url "
                f"({type(engine).__name__}); this protocol expects miles' SGLangApiClient "
                "engines (miles after PR 2752)"
            )
        urls.append(url)
    return urls


def protocol_factory(config: SyncConfig) -> Callable[[Any], P2PWeightsProtocol]:
    """A factory for ``--custom-weight-transfer-protocol-path`` whose protocol uses
    ``config`` (its explicitly set fields win over miles' flags)."""
    cls = type("P2PWeightsProtocol", (P2PWeightsProtocol,), {"sync_config": config})
    return cast("Callable[[Any], P2PWeightsProtocol]", cls)


def install_protocol(config: SyncConfig | None = None) -> type:
    """Make ``--update-weight-transfer-mode p2p`` build ``P2PWeightsProtocol`` in miles'
    updater (``install`` on a miles with the protocol); other modes stay miles' own.
    Returns the protocol class."""
    updater: Any = importlib.import_module(UPDATER_MODULE)
    miles_factory = getattr(updater.get_weight_transfer_protocol, "_miles_factory", None)
    miles_factory = miles_factory or updater.get_weight_transfer_protocol
    factory = protocol_factory(config) if config is not None else P2PWeightsProtocol

    def get_weight_transfer_protocol(args: Any) -> Any:
        if args.update_weight_transfer_mode == "p2p" and not getattr(args, "colocate", False):
            return factory(args)
        return miles_factory(args)

    get_weight_transfer_protocol._miles_factory = miles_factory  # type: ignore[attr-defined]
    updater.get_weight_transfer_protocol = get_weight_transfer_protocol
    logger.info("miles' p2p weight transfer now writes with p2pweights (a WeightTransferProtocol)")
    return cast(type, factory)


def build_protocol(args: Any) -> P2PWeightsProtocol:
    """The factory miles loads by path: ``--custom-weight-transfer-protocol-path
    p2pweights.integrations.miles_protocol.build_protocol``."""
    return P2PWeightsProtocol(args)
