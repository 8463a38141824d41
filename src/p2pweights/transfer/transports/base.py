"""The one interface every transport implements, on both sides of a write.

Trainer side, ``Transport``: register the staging buffers once, connect to the
engine ranks it writes, write batches of (source address, destination address,
length) and block until they finished or failed. Engine side, ``Publisher``:
register an engine rank's weight memory and produce what that rank publishes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2pweights.engines.published import RankPublication
from p2pweights.errors import EngineError

_CONFIGS = {"mooncake": "MooncakeConfig", "nixl": "NixlConfig", "cuda_ipc": "CudaIpcConfig"}


def require_backend(target: RankPublication, backend: str, usable: bool = True) -> None:
    """Refuse a publication made for another transport (or lacking this transport's
    handle, ``usable`` False): the one error every transport, and connect, raise for it."""
    if target.backend == backend and usable:
        return
    lacking = " without the handle it needs" if target.backend == backend else ""
    raise EngineError(
        f"{target.where} published its weights for {target.backend}{lacking}, but this "
        f"session writes over {backend}; set SyncConfig(transport="
        f"{_CONFIGS.get(target.backend, target.backend)}(...)) or have the engine publish "
        f"for {backend}"
    )


@dataclass(frozen=True)
class Write:
    """Copy ``num_bytes`` from local ``src_address`` to remote ``dst_address``."""

    src_address: int
    dst_address: int
    num_bytes: int
    dst_device: int | None = None
    """The GPU the destination lives on, where the engine published it (NIXL needs it)."""


class Transport(ABC):
    """Moves bytes from this process's registered memory into engine ranks' memory."""

    name: str

    @abstractmethod
    def register(self, buffer: torch.Tensor) -> None:
        """Register ``buffer`` (contiguous, host or device) as a write source, once."""

    @abstractmethod
    def unregister(self, buffer: torch.Tensor) -> None:
        """Deregister a buffer ``register`` took (before its memory is freed)."""

    @abstractmethod
    def connect(self, target: RankPublication) -> None:
        """Make ``target`` writable (load its agent, open its session). Idempotent."""

    def disconnect(self, target: RankPublication) -> None:  # noqa: B027 (optional to override)
        """Forget ``target`` (its engine was removed, or restarted on new addresses):
        release what ``connect`` set up for it. Idempotent; a later write needs ``connect``."""

    @property
    def peers(self) -> frozenset[str]:
        """The engine ranks connected now, by transport-level name (``RankPublication.peer``)."""
        return frozenset()

    @abstractmethod
    def write(self, target: RankPublication, writes: Sequence[Write], timeout_s: float) -> None:
        """Issue ``writes`` to ``target`` and return when all completed.

        Raises ``TransferError`` if any failed or the batch is not done after
        ``timeout_s``; a timed-out batch's resources are released before raising.
        Safe to call from one thread per target concurrently.
        """

    def direct_view(
        self, target: RankPublication, address: int, num_bytes: int
    ) -> torch.Tensor | None:
        """A uint8 tensor over ``num_bytes`` of ``target``'s memory at its ``address``, if
        this process writes there as fast with its own device copies as through a write
        (the loaders then fill it directly and the staging copy is skipped); else None.
        Raises ``TransferError`` for bytes outside the memory ``target`` published."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Deregister memory and release every connection."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Publisher(ABC):
    """Engine side: registers one rank's weight memory and describes it for writers."""

    @abstractmethod
    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        """Register the memory holding ``tensors`` (adjacent storage merged into few regions)."""

    @abstractmethod
    def publication(self, tensors: dict[str, torch.Tensor]) -> Any:
        """The JSON-able value sglang serves as ``remote_instance_transfer_engine_info``."""

    @abstractmethod
    def close(self) -> None:
        """Deregister and shut down."""
