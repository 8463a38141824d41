"""verl 0.9.1's checkpoint-engine seam: the backend ``"p2pweights"``, by config keys alone.

verl moves weights from its actor workers to its rollout replicas through a checkpoint
engine (``verl/checkpoint_engine/base.py``). A backend is a ``CheckpointEngine``
registered by name; ``send_weights(weights, global_steps)`` runs on every actor rank
with the full HF-named tensors (``get_per_tensor_param()``), and here it is one
``WeightSyncSession.update`` of all actor ranks together.

Two managers can drive it:

* verl's stock ``CheckpointEngineManager.update_weights`` (no ``checkpoint_manager_class``):
  it aborts every replica's requests (sglang's ``pause_generation(mode="abort")``) and
  releases their KV cache, runs the backend's ``prepare`` / ``build_topology`` /
  ``init_process_group`` on the actor ranks and rollout workers, the actors'
  ``send_weights`` beside the rollout workers' ``receive_weights``, ``finalize``, and
  then restores the KV cache and resumes generation. Here actor rank 0's ``prepare``
  finds the replicas' sglang servers as verl's own ``ServerAdapter`` finds its server
  (the named Ray actor ``sglang_server_<replica>_0``), ``init_process_group`` connects
  the actor ranks to them (again only when they changed), the session runs with
  ``pause_mode="caller"`` (it opens, writes, checks, versions and closes each engine
  but leaves the pause and the resume to verl), and the rollout half receives nothing;
* ``P2PWeightsCheckpointManager`` (``rollout.checkpoint_manager_class``): it connects
  the actor ranks to the replicas' URLs, calls only the actor side and lets p2pweights
  pause and resume each engine (``pause_mode`` retract by default, so requests are kept
  inside sglang instead of aborted, and the KV cache is never released).

Config (``actor_rollout_ref.rollout``)::

    checkpoint_engine:
      backend: p2pweights
      custom_backend_module: p2pweights.integrations.verl
      update_weights_bucket_megabytes: 512       # SyncConfig.buffer_bytes
      engine_kwargs:
        p2pweights:                              # any other SyncConfig field
          transport: {kind: mooncake, protocol: rdma}
    # optional: p2pweights pauses instead of verl aborting
    # checkpoint_manager_class: p2pweights.integrations.verl.P2PWeightsCheckpointManager

Importing this module registers the backend (``custom_backend_module`` makes verl
import it on every worker and in the trainer).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineManager,
    CheckpointEngineRegistry,
)
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.replica import RolloutMode

from p2pweights.config import SyncConfig
from p2pweights.errors import ConfigError
from p2pweights.report import UpdateReport
from p2pweights.sync_session import WeightSyncSession

__all__ = [
    "BACKEND",
    "MANAGER_CLASS",
    "P2PWeightsCheckpointEngine",
    "P2PWeightsCheckpointManager",
    "discover_engine_urls",
    "engine_urls",
    "merge_metrics",
    "sync_config",
]

logger = logging.getLogger(__name__)

BACKEND = "p2pweights"
"""The name the backend is registered under (``checkpoint_engine.backend``)."""
MANAGER_CLASS = f"{__name__}.P2PWeightsCheckpointManager"
"""What ``rollout.checkpoint_manager_class`` must say."""

_KWARGS = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.p2pweights"
_SET_BY_VERL = {
    "buffer_bytes": "set it with checkpoint_engine.update_weights_bucket_megabytes",
    "trainer_rank": "every actor rank sends; the ranks are read from torch.distributed",
    "num_trainer_ranks": "every actor rank sends; the ranks are read from torch.distributed",
    "pipeline_stage": "verl hands every actor rank the whole model (one sender group)",
    "num_pipeline_stages": "verl hands every actor rank the whole model (one sender group)",
}
_NOT_CONNECTED = (
    "the p2pweights checkpoint engine was not connected to the rollout engines: under "
    "verl's CheckpointEngineManager, init_process_group connects it (after prepare and "
    "build_topology), and under P2PWeightsCheckpointManager, connect does"
)
_SERVER_ACTOR = re.compile(r"sglang_server_(\d+)_0")
"""verl's name for the Ray actor of a rollout replica's node-0 sglang server
(``SGLangReplica.launch_servers``; ``ServerAdapter`` looks its own server up by it)."""


def sync_config(bucket_size: int, engine_kwargs: Mapping[str, Any]) -> SyncConfig:
    """The session's config from verl's: ``bucket_size`` (bytes, from
    ``update_weights_bucket_megabytes``) and ``engine_kwargs.p2pweights`` (SyncConfig
    fields; a DictConfig is fine). Raises ``ConfigError`` naming verl's key."""
    given = _plain(engine_kwargs)
    refused = sorted(given.keys() & _SET_BY_VERL.keys())
    if refused:
        key = refused[0]
        raise ConfigError(f"{_KWARGS}.{key} cannot be set here: {_SET_BY_VERL[key]}")
    try:
        return SyncConfig(buffer_bytes=bucket_size, **given)
    except ConfigError as exc:
        raise ConfigError(
            f"{_KWARGS} (update_weights_bucket_megabytes -> buffer_bytes={bucket_size}) is not "
            f"a valid p2pweights SyncConfig: {exc}"
        ) from exc


@CheckpointEngineRegistry.register(BACKEND)
class P2PWeightsCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine on an actor rank: ``send_weights`` is one p2pweights update.

    verl builds one on every actor rank (``is_master`` on rank 0) and on every rollout
    worker. The rollout workers' instances receive nothing (p2pweights writes the
    engines' weight memory itself). The session is made at the first connect, with every
    actor rank (``WeightSyncSession.from_torch_distributed`` over verl's default process
    group), so building one costs nothing on the rollout workers.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.config = sync_config(bucket_size, engine_kwargs)
        self.is_master = is_master
        self._session: WeightSyncSession | None = None
        self._urls: list[str] = []

    def connect(self, urls: Sequence[str]) -> None:
        """Connect this actor rank to the replicas' sglang servers, for
        ``P2PWeightsCheckpointManager`` (p2pweights pauses and resumes the engines).

        Every actor rank together (the first call runs one all-gather). Every call
        connects afresh, on every rank alike (the manager calls it only when the replicas
        changed or the last connect failed): a rank that skipped it while another
        reconnected would prepare its next update differently, and their collectives
        would not match."""
        if self.config.pause_mode == "caller":
            raise ConfigError(
                f"{_KWARGS}.pause_mode=caller leaves pausing to verl's own "
                "CheckpointEngineManager, but P2PWeightsCheckpointManager does not pause the "
                "replicas: drop pause_mode (or the checkpoint_manager_class)"
            )
        self._connect(list(urls), self.config)

    # verl's stock CheckpointEngineManager: it aborts and resumes the replicas itself

    def prepare(self) -> dict[str, Any]:
        """Actor rank 0 finds the replicas' sglang servers (``discover_engine_urls``);
        every other rank, and every rollout worker, has nothing to tell."""
        return {"engine_urls": discover_engine_urls()} if self.is_master else {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every actor rank gets actor rank 0's URLs (its metadata comes first); the
        rollout workers get nothing."""
        urls = metadata[0].get("engine_urls") if metadata else None
        if not urls:
            raise ConfigError(
                "actor rank 0's prepare found no rollout engine URLs (verl lists the actor "
                "ranks' metadata first and builds actor rank 0 with is_master=True)"
            )
        return {"engine_urls": [urls] * actor_wg_world_size}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """On the actor ranks (``engine_urls`` from ``build_topology``): connect to them
        where they changed, for updates in which the caller pauses
        (``pause_mode="caller"``). A no-op on rollout workers (no arguments)."""
        engine_urls = kwargs.pop("engine_urls", None)
        assert not kwargs, f"build_topology passes engine_urls only, got {sorted(kwargs)}"
        if engine_urls is None:
            return
        urls = list(engine_urls)
        if urls != self._urls:  # every actor rank gets the same URLs and decides alike
            self._connect(urls, _caller_pauses(self.config))

    def finalize(self) -> None:
        """Nothing: the connection is kept for the next update."""

    async def receive_weights(  # type: ignore[override]  # verl's backends are async generators
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The rollout half: nothing arrives here (the actor ranks write the engines'
        weight memory), so verl's server adapter loads nothing; it then flushes the
        cache and sets ``global_steps`` as after any update."""
        return
        yield  # an async generator, as verl's server adapter iterates it

    # both managers

    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
    ) -> dict[str, float]:
        """Write ``weights`` into every connected engine; ``global_steps`` is the weight
        version the engines show. Returns this rank's metrics (merged by the manager).
        Raises p2pweights' error when the update failed (every actor rank raises)."""
        if self._session is None or not self._urls:
            raise ConfigError(f"send_weights before the engines were connected: {_NOT_CONNECTED}")
        version = None if global_steps is None else str(global_steps)
        report = self._session.update(weights, version=version)
        return _rank_metrics(report)

    def close(self) -> None:
        """Release the session (verl never calls this; the process exit does it)."""
        if self._session is not None:
            self._session.close()
            self._session, self._urls = None, []

    def _connect(self, urls: list[str], config: SyncConfig) -> None:
        if self._session is None:
            self._session = _new_session(config)
        elif self._session.config.pause_mode != config.pause_mode:
            raise ConfigError(
                "one p2pweights checkpoint engine was driven by both verl's "
                "CheckpointEngineManager and P2PWeightsCheckpointManager; use one"
            )
        self._urls = []  # a failed connect leaves the session unconnected
        self._session.connect(urls)
        self._urls = urls


class P2PWeightsCheckpointManager(CheckpointEngineManager):
    """verl's manager for the p2pweights backend (``rollout.checkpoint_manager_class``),
    optional: verl's own manager drives the backend too, aborting the replicas' requests
    and releasing their KV cache around the update; this one lets p2pweights pause them.

    ``update_weights(global_steps)``: connect every actor rank to the replicas' URLs
    (once, and again when replicas were added or removed), run ``update_weights`` on
    the actor worker group (each rank's ``send_weights``), then tag the replicas'
    outputs with ``global_steps`` as verl's rollout half does. It does not abort,
    resume or release anything itself: p2pweights pauses each engine
    (``SyncConfig.pause_mode``), writes, and resumes it. A KV cache that
    ``sleep_replicas()`` released is restored before the update (verl's own manager
    restores it after its transfer), so generation never resumes without it.
    """

    def __init__(
        self,
        config: Any,
        actor_wg: Any,
        replicas: list[Any],
        fine_grained_config: Any = None,
        load_balancer_handle: Any = None,
    ) -> None:
        if _enabled(fine_grained_config):
            raise ConfigError(
                "fine_grained_config is enabled, but P2PWeightsCheckpointManager does not run "
                "verl's fine-grained (per-replica, Router-driven) updates: p2pweights pauses, "
                "writes, verifies and resumes every engine itself. Disable fine_grained_config, "
                "or pass replica_ranks to update_weights to write some replicas only"
            )
        extra: dict[str, Any] = {}
        if _takes(super().__init__, "fine_grained_config"):  # verl's newer manager
            extra = {"fine_grained_config": fine_grained_config}
            extra["load_balancer_handle"] = load_balancer_handle
        super().__init__(config, actor_wg, replicas, **extra)
        if not issubclass(self.backend_cls, P2PWeightsCheckpointEngine):
            raise ConfigError(
                f"{type(self).__name__} drives the p2pweights backend only, but "
                f"checkpoint_engine.backend is {config.backend!r}; set it to {BACKEND!r} "
                f"(and custom_backend_module to {__name__!r})"
            )
        self.load_balancer = load_balancer_handle
        """verl's Router (kept as the newer manager keeps it; p2pweights does not use it)."""
        self._connected: list[str] | None = None
        self._kv_released = False

    @auto_await
    async def sleep_replicas(self) -> None:
        await super().sleep_replicas()
        self._kv_released = True

    @auto_await
    async def wake_up_replicas(self) -> None:
        await super().wake_up_replicas()
        self._kv_released = False

    @auto_await
    async def update_weights(
        self, global_steps: int | None = None, replica_ranks: list[int] | None = None
    ) -> dict[str, float]:
        """Write every replica, or those of ``replica_ranks`` (the others keep their
        weights), and tag their outputs with ``global_steps``; returns the merged metrics."""
        replicas = _selected(self.replicas, replica_ranks)
        urls = engine_urls(replicas)
        if self._kv_released:
            # a standalone replica's sleep released only its KV cache (if free_cache_engine);
            # it must be back before p2pweights resumes generation
            await self.resume_kv_cache_replicas()
            self._kv_released = False
        actors: Any = self.actor_wg  # a RayWorkerGroup: its worker methods are bound at runtime
        world = actors.world_size
        if urls != self._connected:
            self._connected = None
            ray.get(actors.execute_checkpoint_engine(["connect"] * world, [urls] * world))
            self._connected = urls
        results = ray.get(actors.update_weights(global_steps=global_steps, mode=self.backend))
        if global_steps is not None:
            await asyncio.gather(
                *(r.server_handle.set_global_steps.remote(global_steps) for r in replicas)
            )
        return merge_metrics(results)


def _enabled(fine_grained_config: Any) -> bool:
    """Whether verl's ``FineGrainedWeightUpdateConfig`` (a dataclass, a dict or a DictConfig)
    turns fine-grained updates on."""
    if fine_grained_config is None:
        return False
    if isinstance(fine_grained_config, Mapping):
        return bool(fine_grained_config.get("enabled", False))
    return bool(getattr(fine_grained_config, "enabled", False))


def _takes(function: Any, name: str) -> bool:
    import inspect

    return name in inspect.signature(function).parameters


def _selected(replicas: Sequence[Any], replica_ranks: Sequence[int] | None) -> list[Any]:
    """``replicas`` whose ``replica_rank`` is in ``replica_ranks`` (all of them for None), in
    replica order; ``ConfigError`` naming ranks that are not there."""
    if replica_ranks is None:
        return list(replicas)
    known = {replica.replica_rank for replica in replicas}
    unknown = sorted(set(replica_ranks) - known)
    if unknown:
        raise ConfigError(
            f"update_weights(replica_ranks=...) names replica_ranks {unknown}, but the "
            f"manager's replicas are {', '.join(str(rank) for rank in sorted(known))}"
        )
    wanted = set(replica_ranks)
    return [replica for replica in replicas if replica.replica_rank in wanted]


def discover_engine_urls() -> list[str]:
    """The URL of each rollout replica's sglang server, in replica order, found as verl's
    ``ServerAdapter`` finds its own server: the named Ray actor
    ``sglang_server_<replica_rank>_0`` (reward and teacher servers are named apart) and its
    ``get_server_address()``. Raises ``ConfigError`` when there is none."""
    found = sorted(
        (int(match.group(1)), name)
        for name in ray.util.list_named_actors()
        if (match := _SERVER_ACTOR.fullmatch(str(name)))
    )
    if not found:
        raise ConfigError(
            "no rollout sglang server to write: no Ray actor named sglang_server_<replica>_0 "
            "in this job's namespace (verl's SGLangReplica names its servers so; p2pweights "
            "writes sglang rollouts only)"
        )
    servers = [ray.get_actor(name) for _, name in found]
    addresses: list[tuple[str, int]] = ray.get(
        [server.get_server_address.remote() for server in servers]
    )
    return [_http_url(str(host), int(port)) for host, port in addresses]


def engine_urls(replicas: Sequence[Any]) -> list[str]:
    """The sglang server URL of each replica (``RolloutReplica.server_address``: its
    node-rank-0 server, ``host:port``), refusing replicas p2pweights cannot write."""
    if not replicas:
        raise ConfigError("the checkpoint manager has no rollout replicas to write")
    for replica in replicas:
        if replica.rollout_mode is not RolloutMode.STANDALONE:
            raise ConfigError(
                f"rollout replica {replica.replica_rank} ({replica.server_address}) runs in "
                f"{replica.rollout_mode} mode; p2pweights writes standalone (disaggregated) "
                f"replicas only: a hybrid or colocated replica releases its weights when it "
                f"sleeps. Keep checkpoint_engine.backend=naive for colocated training"
            )
    return [f"http://{replica.server_address}" for replica in replicas]


_PREFIX = "p2pweights/"
_SUMMED = ("bytes", "delta_sent_bytes", "num_engine_ranks")
"""Metrics each actor rank counts for its own engine ranks: the update's are their sum."""
_LEAST = ("engines_verified",)
"""An engine counts as verified only where every rank's writes into it were."""


def merge_metrics(per_rank: Iterable[object]) -> dict[str, float]:
    """The actor ranks' ``send_weights`` metrics (``UpdateReport.metrics``, docs/metrics.md)
    as one: bytes summed over the ranks, ``engines_verified`` the least any rank counted,
    every other value (seconds, pause, the busiest engine rank's bytes) the largest, and
    ``gb_per_s`` the summed bytes over the slowest rank's seconds."""
    ranks = [m for m in per_rank if isinstance(m, Mapping)]
    if not ranks:
        return {}
    merged: dict[str, float] = {}
    for name in dict.fromkeys(key for m in ranks for key in m):
        values = [float(m[name]) for m in ranks if name in m]
        short = name.removeprefix(_PREFIX)
        if short in _SUMMED:
            merged[name] = sum(values)
        elif short in _LEAST:
            merged[name] = min(values)
        else:
            merged[name] = max(values)
    seconds = merged.get(f"{_PREFIX}seconds", 0.0)
    if seconds > 0 and f"{_PREFIX}bytes" in merged:
        merged[f"{_PREFIX}gb_per_s"] = merged[f"{_PREFIX}bytes"] / seconds / 1e9
    return merged


def _rank_metrics(report: UpdateReport) -> dict[str, float]:
    return {name: float(value) for name, value in report.metrics(prefix=_PREFIX).items()}


def _caller_pauses(config: SyncConfig) -> SyncConfig:
    """The session's config under verl's stock manager, which aborts and resumes the
    replicas itself: ``pause_mode="caller"``; any other pause mode set is refused."""
    if "pause_mode" in config.model_fields_set and config.pause_mode != "caller":
        raise ConfigError(
            f"{_KWARGS}.pause_mode={config.pause_mode} cannot apply: verl's "
            "CheckpointEngineManager aborts and resumes the replicas itself. Drop pause_mode, "
            f"or set actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER_CLASS} to "
            "let p2pweights pause them"
        )
    return config.model_copy(update={"pause_mode": "caller"})


def _http_url(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):  # IPv6, as verl brackets it
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _new_session(config: SyncConfig) -> WeightSyncSession:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return WeightSyncSession.from_torch_distributed(config)
    return WeightSyncSession(config)


def _plain(value: Any) -> Any:
    """OmegaConf containers (verl's config) as plain dicts and lists, for pydantic."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    return value
