"""Where the staging buffers live: pinned host memory, or a GPU a transport reads."""

from __future__ import annotations

import logging

import torch

from p2pweights.config import CudaIpcConfig, TransportConfigBase

logger = logging.getLogger(__name__)

__all__ = ["staging_device_for"]


def staging_device_for(
    transport: TransportConfigBase, given: torch.device | str | None
) -> torch.device:
    """As given, else on the GPU a CUDA IPC transport copies from (device copies over
    NVLink), else in pinned host memory."""
    if given is not None:
        device = torch.device(given)
        transport_gpu = getattr(transport, "device", None)
        if (
            device.type == "cuda"
            and None not in (device.index, transport_gpu)
            and (device.index != transport_gpu)
        ):
            logger.warning(
                "staging on %s while CudaIpcConfig copies from cuda:%d: every copy then "
                "crosses GPUs twice; stage on the transport's GPU",
                device,
                transport_gpu,
            )
        return device
    if isinstance(transport, CudaIpcConfig) and torch.cuda.is_available():
        gpu = transport.device
        return torch.device("cuda", torch.cuda.current_device() if gpu is None else gpu)
    return torch.device("cpu")
