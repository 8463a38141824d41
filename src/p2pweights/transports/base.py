"""The one interface every transport implements, on both sides of a write.

Trainer side, ``Transport``: register the staging buffers once, connect to the
engine ranks it writes, write batches of (source address, destination address,
length) and block until they finished or failed. Engine side, ``Publisher``:
register an engine rank's weight memory and produce what that rank publishes.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2pweights.errors import ConfigError
from p2pweights.polling import poll_until
from p2pweights.wire.publication import RankPublication

logger = logging.getLogger(__name__)


def poll_transfers(ask: Callable[[], bool], deadline: float, *, first: bool | None = None) -> bool:
    """``poll_until`` as transports poll the transfers they wait for: sleeping 20 us at
    first, doubling up to 1 ms."""
    return poll_until(ask, deadline, sleep_s=20e-6, max_sleep_s=1e-3, first=first)


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
    def protocol(self) -> str:
        """What this transport writes over, as set up (not as configured): Mooncake's
        "rdma" or "tcp", NIXL's backend, "device copy" for CUDA IPC."""
        return ""

    def describe(self) -> str:
        """``"mooncake/tcp"``: the transport's name and the protocol it writes over, for
        reports and logs."""
        return f"{self.name}/{self.protocol}" if self.protocol else self.name

    @property
    def peers(self) -> frozenset[str]:
        """The engine ranks connected now, by transport-level name (``RankPublication.peer``)."""
        return frozenset()

    @abstractmethod
    def write(self, target: RankPublication, writes: Sequence[Write], timeout_s: float) -> None:
        """Issue ``writes`` to ``target`` and return when all completed.

        Raises ``TransferError`` if any failed, or was refused, and every one issued is
        known finished or cancelled. Raises ``UnsettledWrite`` if, after ``timeout_s``,
        some were neither: they may still read their source and land in ``target``, so
        their staging memory stays untouched, registered and allocated, and ``target``
        torn, until the error's ``settle`` returns True (the transport then releases what
        they held; ``close`` deregisters nothing they still read). Safe to call from one
        thread per target concurrently.
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


class InFlight(ABC):
    """Transfers a write gave up on at its deadline that were neither confirmed finished
    nor cancelled; ``settle`` polls them (and releases what they hold once they ended)."""

    def __init__(self, sources: Sequence[tuple[int, int]]) -> None:
        # (address, num_bytes) of the source memory they read.
        self.sources = tuple(sources)
        self._lock = threading.Lock()
        self._settled = False

    def settle(self, timeout_s: float) -> bool:
        """Poll at least once, then until ``timeout_s`` passed: True once every transfer
        finished or failed (and was released)."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(timeout_s, 0.0)):
            return False  # another thread is settling them right now
        try:
            if not self._settled and poll_transfers(self._poll, deadline):
                self._release()
                self._settled = True
            return self._settled
        finally:
            self._lock.release()

    def reads(self, address: int, num_bytes: int) -> bool:
        """Whether they read any of ``[address, address + num_bytes)``."""
        return any(a < address + num_bytes and address < a + n for a, n in self.sources)

    @abstractmethod
    def _poll(self) -> bool:
        """One check without blocking: whether every transfer finished or failed."""

    def _release(self) -> None:  # noqa: B027 (optional to override)
        """Release what the transfers held (called once, after they ended)."""


class GivenUp:
    """The transfers one transport's writes gave up on (``InFlight``), until each ended:
    the staging memory they read stays registered, and at close what drives them is kept
    for the life of the process. The transport calls it under its own lock."""

    def __init__(self, transport: str, driver: str, noun: str) -> None:
        # for the log: "Mooncake", its "engine", "write(s)" given up on
        self._transport, self._driver, self._noun = transport, driver, noun
        self._entries: list[InFlight] = []

    def add(self, entry: InFlight) -> None:
        self._entries.append(entry)

    def unended(self) -> list[InFlight]:
        """Those one poll does not find ended (the ended ones are forgotten)."""
        self._entries = [entry for entry in self._entries if not entry.settle(0.0)]
        return list(self._entries)

    def keep_registered(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` must stay registered: one not ended still reads it (logged)."""
        address, num_bytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        if not any(entry.reads(address, num_bytes) for entry in self.unended()):
            return False
        logger.warning(
            "%s: a staging buffer at 0x%x stays registered: a write given up on still reads it",
            self._transport,
            address,
        )
        return True

    def keep_at_close(self, driver: object, name: Callable[[], str], registered: list[Any]) -> bool:
        """At close, whether any has not ended; if so ``driver`` (the engine or agent whose
        threads may still move their bytes, ``name()`` in the log) and ``registered`` (the
        memory they read) are never freed (``quarantine``)."""
        unended = self.unended()
        if not unended:
            return False
        quarantine(
            (driver, unended, registered),
            f"{self._transport} {self._driver} {name()} with {len(registered)} registered "
            f"buffer(s)",
            f"{len(unended)} {self._noun}(s) given up on have not ended",
        )
        return True


def source_region(buffer: torch.Tensor) -> tuple[int, int]:
    """(address, num_bytes) of a staging buffer to register as a write source."""
    if not buffer.is_contiguous():
        raise ConfigError("a staging buffer must be contiguous to be registered")
    return buffer.data_ptr(), buffer.numel() * buffer.element_size()


_QUARANTINE: list[object] = []
"""What a closed transport or executor could not release because a write given up on may
still use it: kept referenced for the life of the process, so it is never freed."""


def quarantine(what: object, described: str, reason: str) -> None:
    """Never free ``what`` (``described`` for the log): memory an unsettled write may still
    read, or the engine object still driving it, deliberately leaked."""
    _QUARANTINE.append(what)
    logger.warning(
        "p2pweights keeps %s for the life of the process, neither deregistered nor freed: %s",
        described,
        reason,
    )


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
