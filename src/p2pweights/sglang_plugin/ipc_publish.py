"""One engine rank's CUDA IPC publication: its GPU weights shared by IPC handle, kept live.

What the ``p2pweights_cuda_ipc`` plugin publishes per TP rank, for trainers on the
engine's own host (colocated training and rollout, as verl's and slime's colocated mode
run): ``transports.cuda_ipc.CudaIpcPublisher``'s publication (the local engine's too),
each device allocation holding the rank's ``model.named_parameters()`` shared by the
IPC handle of its base, with the address of each block in the engine process, the GPU
and the host. ``IpcLivePublication`` keeps it true the way ``publish.LivePublication``
keeps the NIXL one: ``"live": true``, an ``"epoch"``, published afresh with the next
epoch when a parameter's storage moved.

A CUDA IPC handle cannot be revoked: a trainer that opened one keeps its mapping until
it closes it. What keeps writers off storage the engine gave up is that the old
publication is no longer served: a fresh one replaces it (writers re-read live
publications once the update session is open, before writing, and close the old
mappings), and where none can be made the rank publishes why instead (``"error"``),
which every writer refuses. The same goes for a rank that cannot publish at all (an
sglang server on the CPU): it is logged and published as an error, never raised into
sglang, so the server serves and a trainer's connect names the reason.
Nothing here imports sglang.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from p2pweights.errors import ConfigError, P2PWeightsError, TransportError
from p2pweights.sglang_plugin.publish import (
    HOOK_PUT_TIMEOUT_S,
    LivePublication,
    put_publication,
)
from p2pweights.transports.base import Publisher

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

PLUGIN = "p2pweights_cuda_ipc"
BACKEND = "cuda_ipc"


class IpcLivePublication(LivePublication):
    """One engine rank's live CUDA IPC publication (see the module docstring)."""

    plugin = PLUGIN

    def __init__(self, engine_rank: int, bootstrap_url: str) -> None:
        super().__init__(engine_rank, BACKEND, bootstrap_url)
        # a withdrawal (``close``) that could not be put: the stale handles are still served
        self._withdrawal_owed = False

    def publish(self, model: nn.Module, moved: list[str] | None = None) -> None:
        super().publish(model, moved)
        self._withdrawal_owed = False  # a newer publication replaced the stale handles

    def _register(
        self, model: nn.Module, extra: dict[str, torch.Tensor]
    ) -> tuple[Publisher, dict[str, Any]]:
        from p2pweights.transports.cuda_ipc import CudaIpcPublisher

        params = gpu_parameters(model, self.engine_rank)
        params.update(extra)
        publisher = CudaIpcPublisher(engine_rank=self.engine_rank)
        try:
            publisher.register(params)
            info = publisher.publication(params)
        except P2PWeightsError as exc:
            publisher.close()
            hint = _allocator_hint() if isinstance(exc, TransportError) else ""
            raise ConfigError(
                f"tp rank {self.engine_rank}: cannot share the weights by CUDA IPC handle "
                f"({exc}){hint}"
            ) from exc
        except BaseException:
            publisher.close()
            raise
        return publisher, info

    def _published_over(self, info: dict[str, Any]) -> str:
        segments = info["segments"]
        gpus = sorted({s["gpu_id"] for s in segments})
        return (
            f"(GPU {', '.join(map(str, gpus))}) as {len(segments)} CUDA IPC block(s) of "
            f"{info['agent_name']}"
        )

    def close(self) -> None:
        """Stop serving this rank's handles: publish why instead (an ``error``, the next
        epoch), so no writer uses them. Called when publishing afresh failed. A handle
        cannot be revoked, so a withdrawal that could not be put stays owed: the next
        failed attempt (the next hook, which runs before the trainer re-reads the
        publication and writes) puts it again."""
        had = self._publisher is not None
        super().close()
        if had or self._withdrawal_owed:
            self._withdrawal_owed = not withdraw(
                self.engine_rank,
                self.bootstrap_url,
                f"its weights moved to new storage and could not be published afresh (see "
                f"the engine's log, {PLUGIN}); restart the engine",
                epoch=self.epoch + 1,
                in_hook=True,  # inside sglang's update hooks: one short attempt
            )


def gpu_parameters(model: nn.Module, engine_rank: int) -> dict[str, torch.Tensor]:
    """``model``'s parameters by name; refuses (``ConfigError``) any not on a GPU, or none."""
    params = {name: p.data for name, p in model.named_parameters()}
    if not params:
        raise ConfigError(f"tp rank {engine_rank}: the model has no parameters to publish")
    elsewhere = sorted({str(t.device) for t in params.values() if t.device.type != "cuda"})
    if elsewhere:
        raise ConfigError(
            f"tp rank {engine_rank}: {PLUGIN} shares GPU memory only, and this sglang server "
            f"holds its weights on {', '.join(elsewhere)}. Start the server on a GPU of the "
            f"trainer's host (--device cuda), or publish over NIXL instead "
            f"(SGLANG_PLUGINS=p2pweights_nixl) and write with NixlConfig"
        )
    return params


def publish_ipc(
    engine_rank: int, bootstrap_url: str, model: nn.Module, *, memory_saver: bool = False
) -> IpcLivePublication | None:
    """Publish ``model``'s weights for CUDA IPC (epoch 0); None where the rank cannot (it
    logged why and published the reason as an error). ``memory_saver``: sglang's memory
    saver manages the weights (refused). Never raises an ``Exception``."""
    published = IpcLivePublication(engine_rank, bootstrap_url)
    try:
        if memory_saver:
            raise ConfigError(
                f"tp rank {engine_rank}: sglang's memory saver (--enable-memory-saver) holds "
                f"the weights in CUDA virtual-memory allocations, which CUDA IPC handles "
                f"cannot share, and gives them new physical memory at every "
                f"resume_memory_occupation at the same addresses; start the server without "
                f"--enable-memory-saver to publish with {PLUGIN}"
            )
        published.publish(model)
    except Exception as exc:
        logger.error(
            "%s: tp rank %d does not publish its weights for CUDA IPC: %s",
            PLUGIN,
            engine_rank,
            exc,
            exc_info=not isinstance(exc, ConfigError),
        )
        withdraw(engine_rank, bootstrap_url, str(exc), epoch=0)
        return None
    return published


def withdraw(
    engine_rank: int, bootstrap_url: str, reason: str, *, epoch: int, in_hook: bool = False
) -> bool:
    """Publish, in place of the rank's weights, why it has none (``wire.publication``'s
    ``"error"``); whether it was put (logged where not). Never raises an ``Exception``.
    ``in_hook``: inside sglang's update hooks, one attempt of ``HOOK_PUT_TIMEOUT_S``."""
    info = {"backend": BACKEND, "error": reason, "live": True, "epoch": epoch}
    try:
        if in_hook:
            put_publication(bootstrap_url, engine_rank, info, HOOK_PUT_TIMEOUT_S, retry=False)
        else:
            put_publication(bootstrap_url, engine_rank, info)
    except Exception:
        logger.exception(
            "%s: tp rank %d could not publish why it has no publication either; trainers "
            "may read an earlier one until a later hook puts it",
            PLUGIN,
            engine_rank,
        )
        return False
    return True


def _allocator_hint() -> str:
    """Where ``cudaIpcGetMemHandle`` fails: memory mapped through CUDA's virtual memory
    API (``cuMemCreate`` / ``cuMemMap``), which legacy IPC handles cannot share."""
    import torch

    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "")()
    if "expandable_segments:True" in str(settings):
        return (
            "; torch's allocator runs with expandable_segments:True here, whose memory "
            "CUDA IPC handles cannot share: start the server without it in "
            "PYTORCH_CUDA_ALLOC_CONF"
        )
    return (
        "; memory that sglang's --enable-memory-saver or torch's expandable_segments maps "
        "cannot be shared by CUDA IPC handle: start the server without them"
    )
