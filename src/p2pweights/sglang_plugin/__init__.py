"""An sglang general plugin: released sglang servers publish their weights over NIXL,
or by CUDA IPC handle for trainers on their own host.

Enable it on the engine host with ``pip install 'p2pweights[nixl,engine]'`` and
``SGLANG_PLUGINS=p2pweights_nixl`` (the entry point ``p2pweights_nixl`` in group
``sglang.srt.plugins``); ``SGLANG_REMOTE_INSTANCE_NIXL_BACKEND`` picks the NIXL
backend (default UCX). See docs/nixl-plugin.md.

``SGLANG_PLUGINS=p2pweights_cuda_ipc`` (``pip install 'p2pweights[engine]'``, no NIXL)
runs the same hooks but publishes each rank's GPU weights by CUDA IPC handle
(``ipc_publish``), for ``CudaIpcConfig`` trainers colocated with the server on its GPUs
(docs/cuda-ipc-plugin.md). A server on the CPU cannot be shared that way: its ranks
log why and publish the reason instead, and the server serves on. Where both entry
points load (``SGLANG_PLUGINS`` unset loads every installed plugin), NIXL publishes, with
a warning.

sglang (0.5.21 - 0.5.23) runs ``load_plugins()`` early in every process it starts
(launcher, schedulers, detokenizer) and then applies the hooks plugins registered.
This plugin registers six, the first three where sglang's Mooncake publishing lives:

1. REPLACE ``EngineInfoBootstrapServer`` with ``NixlAwareBootstrapServer``: the same
   server, which also stores a rank's NIXL dict and answers it at
   ``/remote_instance_transfer_engine_info?rank=R`` in the shape of sglang PR #35712.
2. BEFORE ``Engine._launch_scheduler_processes`` (launcher process, after the server
   args are resolved, before any rank starts): start that server on the head node.
   sglang starts it only under ``--remote-instance-weight-loader-start-seed-via-transfer-engine``;
   with the plugin that flag is not needed (nor Mooncake). If it is given anyway,
   sglang's own start-up runs the replaced server and the plugin leaves it alone.
3. AFTER ``ModelRunner.initialize`` (each TP rank's scheduler process): the model is
   loaded, ``process_weights_after_loading`` and every post-load transform have run,
   so the parameter addresses are final (the CUDA graphs the scheduler captures next
   read them there: writes land in place, so the graphs stay valid). Register the weights with
   a NIXL agent (or take their CUDA IPC handles) and
   PUT the publication to the bootstrap server, keyed by TP rank as sglang keys
   Mooncake info. With the Mooncake flag also set, this PUT comes after sglang's and
   replaces it. Draft models (speculative decoding) are not published: they would
   overwrite the target model's entry for the same TP rank.
4. and 5. AFTER the model runner's ``WeightUpdater.begin_weight_update`` and
   ``end_weight_update`` (each TP rank): check that every parameter still lives where
   it was published. sglang's processing may replace a parameter's storage (the CPU
   backend's AMX weight packing puts a new tensor into the model after every load);
   the old address then points at freed memory. The rank then publishes afresh (a new
   agent registering the new storage, the next ``epoch``) and closes the old agent, so
   no write can reach the freed memory (CUDA IPC: the new handles replace the old ones,
   and where that fails the rank publishes an error in their place). Publications say
   ``"live": true``: writers re-read them once the update session is open, before
   writing. After ``begin`` the rank also PUTs an empty write-digest record for the new
   session (see 6.).
6. BEFORE the runner's ``end_weight_update`` (each TP rank): the writes are in and
   sglang's postprocess (which may repack or move the weights) has not run. The rank
   runs ``p2pweights.engine_side.steps``'s before-end steps on its published parameters and
   PUTs the record (a digest of every parameter, this session's number) to the
   bootstrap server under the role ``p2pweights-digests``; writers compare it with
   what they staged (``SyncConfig.verify_writes``). Publications say
   ``"write_digests": true``; ``P2PWEIGHTS_WRITE_DIGESTS=0`` in the engine's
   environment opts out (no digests, the record carries none). A failure here is
   logged and recorded, never raised into sglang: the writer then fails the update
   instead.

Importing this package imports neither sglang nor NIXL; ``register()`` imports
sglang's hook registry, and the hooks import the rest when they run. Everything of
sglang it uses goes through ``p2pweights.replica.sglang.facade`` (which imports sglang
only when called and no replica code), and ``replica.sglang.compat`` checks each hook
target below (``PLUGIN_REQUIRED``).
"""

from __future__ import annotations

import logging
from typing import Any

from p2pweights import environment
from p2pweights.config import NixlConfig
from p2pweights.replica.sglang.hook_targets import (
    BEGIN_TARGET,
    BOOTSTRAP_SERVER_TARGET,
    END_TARGET,
    HOOK_TARGETS,
    LAUNCH_TARGET,
    RUNNER_TARGET,
)

logger = logging.getLogger(__name__)

__all__ = ["HOOK_TARGETS", "register", "register_cuda_ipc"]

# Alive for the life of the process, by id of the model runner they publish: each owns
# a NIXL agent whose registrations writers use; dropping it would deregister the weights.
_published: dict[int, Any] = {}
_sides: dict[int, Any] = {}
"""``engine_side.steps.RankSide`` of each published runner, by id of the model runner."""
_bootstrap_server: Any = None
_asked: set[str] = set()
"""The backends the entry points sglang loaded in this process asked to publish for."""


def register() -> None:
    """The entry point ``p2pweights_nixl``, which sglang's ``load_plugins()`` calls in each
    process: publish over NIXL."""
    _register("nixl")


def register_cuda_ipc() -> None:
    """The entry point ``p2pweights_cuda_ipc``: publish by CUDA IPC handle."""
    _register("cuda_ipc")


def publishing_backend() -> str:
    """What this process's ranks publish for: NIXL where its entry point loaded (also
    beside ``p2pweights_cuda_ipc``, as with ``SGLANG_PLUGINS`` unset), else CUDA IPC."""
    return "nixl" if "nixl" in _asked or not _asked else "cuda_ipc"


def _register(backend: str) -> None:
    """Register the hooks once per process, whichever entry points load."""
    first = not _asked
    _asked.add(backend)
    if not first:
        return
    from p2pweights.replica.sglang import facade
    from p2pweights.sglang_plugin.bootstrap import NixlAwareBootstrapServer

    facade.register_hook(BOOTSTRAP_SERVER_TARGET, NixlAwareBootstrapServer, "REPLACE")
    facade.register_hook(LAUNCH_TARGET, start_bootstrap_server, "BEFORE")
    facade.register_hook(RUNNER_TARGET, publish_after_initialize, "AFTER")
    facade.register_hook(BEGIN_TARGET, republish_after_begin, "AFTER")
    facade.register_hook(END_TARGET, digests_before_end, "BEFORE")
    facade.register_hook(END_TARGET, republish_after_end, "AFTER")


def start_bootstrap_server(*_args: Any, **_kwargs: Any) -> None:
    """BEFORE hook of ``Engine._launch_scheduler_processes``: serve the ranks' info."""
    global _bootstrap_server
    from p2pweights.replica.sglang import facade
    from p2pweights.sglang_plugin.bootstrap import NixlAwareBootstrapServer

    if _bootstrap_server is not None or facade.parallel().node_rank != 0:
        return
    if facade.model_args().remote_instance_weight_loader_start_seed_via_transfer_engine:
        logger.warning(
            "p2pweights: --remote-instance-weight-loader-start-seed-via-transfer-engine is "
            "also set; sglang serves the bootstrap server and registers the weights with "
            "Mooncake too, but each rank's %s publication replaces its Mooncake one",
            "NIXL" if publishing_backend() == "nixl" else "CUDA IPC",
        )
        return
    _bootstrap_server = NixlAwareBootstrapServer(
        host=facade.serving_args().host, port=facade.model_args().engine_info_bootstrap_port
    )


def publish_after_initialize(_result: Any, runner: Any, *_args: Any, **_kwargs: Any) -> None:
    """AFTER hook of ``ModelRunner.initialize``: register and publish this rank's weights."""
    from p2pweights.sglang_plugin.publish import LivePublication

    if getattr(runner, "is_draft_worker", False):
        logger.info("p2pweights: not publishing the draft model's weights")
        return
    from p2pweights.engine_side.steps import RankSide
    from p2pweights.replica.sglang import facade

    if publishing_backend() == "cuda_ipc":
        from p2pweights.sglang_plugin.ipc_publish import publish_ipc

        saver = getattr(runner, "memory_saver_adapter", None)
        published: LivePublication | None = publish_ipc(
            _tp_rank(runner),
            facade.bootstrap_url(),
            runner.model,
            memory_saver=bool(getattr(saver, "enabled", False)),
        )
        if published is None:  # it logged and published why (a CPU server)
            return
    else:
        if len(_asked) > 1:
            logger.warning(
                "p2pweights: both p2pweights_nixl and p2pweights_cuda_ipc are loaded (an "
                "unset SGLANG_PLUGINS loads every installed plugin); publishing over NIXL. "
                "Set SGLANG_PLUGINS=p2pweights_cuda_ipc to publish by CUDA IPC handle"
            )
        published = LivePublication(_tp_rank(runner), NixlConfig().backend, facade.bootstrap_url())
        published.publish(runner.model)
    _published[id(runner)] = published
    _sides[id(runner)] = RankSide(
        published.engine_rank, write_digests=environment.write_digests(default=True)
    )


def digests_before_end(updater: Any, *_args: Any, **_kwargs: Any) -> None:
    """BEFORE hook of the runner's ``end_weight_update``: record the written bytes' digests."""
    runner = updater.get_model_runner()
    side, published = _sides.get(id(runner)), _published.get(id(runner))
    if side is None or published is None:  # a draft runner, or one published by sglang alone
        return
    params = {name: p.data for name, p in runner.model.named_parameters()}
    if published.scratch is not None:  # a delta written there is applied first
        from p2pweights.wire.delta import SCRATCH_NAME

        params[SCRATCH_NAME] = published.scratch
    record = side.before_end(params)
    version = _weight_version()
    if version is not None:  # this update's marker: an earlier update's record never has it
        record["weight_version"] = version
    published.put_record(record)


def _weight_version() -> str | None:
    """The weight version sglang's scheduler holds in this process (the trainer's
    ``p2pweights-updating:<v>`` while it writes), None where it cannot be read."""
    from p2pweights.replica.sglang import facade

    try:
        version = facade.serving_args().weight_version
    except Exception:  # another sglang release: the record's number alone then decides
        return None
    return version if isinstance(version, str) else None


def republish_after_begin(_result: Any, updater: Any, *_args: Any, **_kwargs: Any) -> None:
    """AFTER hook of the runner's ``begin_weight_update``: a restore may move parameters;
    the new session's digest record (none yet) replaces the last session's."""
    _republish_if_moved(updater, "begin_weight_update")
    runner = updater.get_model_runner()
    side, published = _sides.get(id(runner)), _published.get(id(runner))
    if side is not None and published is not None:
        landed = None
        if published.landed is not None:  # senders flag each parameter as its writes land
            params = {name: p.data for name, p in runner.model.named_parameters()}
            landed = (published.landed, params)
        published.put_record(side.after_begin(published.scratch, landed))


def republish_after_end(_result: Any, updater: Any, *_args: Any, **_kwargs: Any) -> None:
    """AFTER hook of the runner's ``end_weight_update``: postprocess may move parameters."""
    _republish_if_moved(updater, "end_weight_update")


def _republish_if_moved(updater: Any, after: str) -> None:
    runner = updater.get_model_runner()
    published = _published.get(id(runner))
    if published is not None:  # a draft runner, or one published by sglang alone
        published.refresh(runner.model, after)


def _tp_rank(runner: Any) -> int:
    """The TP rank sglang keys this runner's transfer info by."""
    transporter = getattr(runner, "remote_instance_weight_transporter", None)
    if transporter is not None:
        return int(transporter.tp_rank)
    from p2pweights.replica.sglang import facade

    return int(facade.parallel().tp_rank)
