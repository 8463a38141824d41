"""Writes over the Mooncake transfer engine, and the engine-side publisher sglang's format expects.

Both sides run one ``TransferEngine`` in peer-to-peer handshake mode
(``"P2PHANDSHAKE"``: no metadata server; a peer is named by ``"host:rpc_port"``).

Why writes go through ``transfer_submit_write`` / ``transfer_check_status`` rather
than the batch calls: in Mooncake 0.3.x ``batch_transfer_sync_write`` and
``get_batch_transfer_status`` both block in C++ (busy-waiting) until the batch
finishes or Mooncake's own timeout passes, which is ``MC_TRANSFER_TIMEOUT``
(default 30 s, at least 5 s) plus one nanosecond per byte; neither can honour a
caller's ``timeout_s``. Submitting each write as a one-entry batch and polling its
status without blocking gives every write its own verdict and a deadline we
control.

A write still in flight at the deadline cannot be cancelled, and may still land: the
batch is neither finished nor failed until ``transfer_check_status`` says so (which
also frees its descriptor). Mooncake's own "timed out" status (-2, a slice slower than
``MC_SLICE_TIMEOUT``) is no verdict either: the slice is still posted and the batch
not freed. ``write`` then raises ``UnsettledWrite``, whose ``settle`` keeps polling
those batches; until they ended, ``unregister`` and ``close`` leave the memory they
read registered (``close`` keeps the engine itself, whose threads still move them).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from p2pweights import environment, logs
from p2pweights.config import MooncakeConfig
from p2pweights.errors import (
    TransferError,
    TransportError,
    UnsettledWrite,
    some_of,
    where,
)
from p2pweights.transports.base import (
    GivenUp,
    InFlight,
    Publisher,
    Transport,
    Write,
    poll_transfers,
    source_region,
)
from p2pweights.transports.regions import RegionIndex, merged_regions, weights_info
from p2pweights.wire.publication import RankPublication, require_backend

logger = logging.getLogger(__name__)

# transfer_submit_write returns a batch id (a pointer) or -1 as an unsigned 64-bit value.
_SUBMIT_FAILED = {0, -1, 2**64 - 1}
# transfer_check_status results
_DONE, _PENDING, _FAILED, _TIMED_OUT = 1, 0, -1, -2


_RDMA_SYSFS = Path("/sys/class/infiniband")


def installed_protocol(
    device_name: str,
    topology: Callable[[str], str],
    *,
    root: Path = _RDMA_SYSFS,
    force_tcp: bool | None = None,
) -> str:
    """What Mooncake installs on this host: "rdma" or "tcp".

    Its Python binding ignores the protocol it is given. It installs RDMA when its
    topology discovery finds an RDMA device (among ``device_name``'s, comma-separated,
    when given) and ``MC_FORCE_TCP`` is unset, and TCP otherwise. The kernel's device
    list answers for a host with none; where it lists some, Mooncake's own discovery
    (``topology``: ``TransferEngine.get_local_topology``, about 1 s) says whether it can
    use them (a container's libibverbs may not).
    """
    if environment.mooncake_force_tcp() if force_tcp is None else force_tcp:
        return "tcp"
    wanted = [name for name in device_name.split(",") if name]
    listed = [d.name for d in root.glob("*") if not wanted or d.name in wanted]
    if not listed:
        return "tcp"
    answer = topology(device_name)
    try:
        found: dict[str, list[list[str]]] = json.loads(answer)
        hcas = {hca for entry in found.values() for group in entry for hca in group}
    except (ValueError, TypeError, AttributeError) as exc:
        raise TransportError(
            f"Mooncake's topology of this host's RDMA devices ({', '.join(listed)}) could not "
            f"be read ({exc}): {answer!r:.200}"
        ) from exc
    return "rdma" if hcas else "tcp"


def choose_protocol(
    protocol: str,
    device_name: str,
    topology: Callable[[str], str],
    *,
    root: Path = _RDMA_SYSFS,
    force_tcp: bool | None = None,
) -> str:
    """The protocol a transport configured with ``protocol`` writes over; raises
    ``TransportError`` for "rdma" where Mooncake would install TCP. "tcp" on a host where
    Mooncake finds a device gives "rdma" (it ignores the protocol asked; ``MC_FORCE_TCP=1``
    on trainer and engines keeps them on TCP)."""
    found = installed_protocol(device_name, topology, root=root, force_tcp=force_tcp)
    if found == "rdma" or protocol == "tcp":
        if found != protocol and protocol != "auto":
            logger.info(
                "MooncakeConfig(protocol=%r): Mooncake finds RDMA devices and writes over "
                "RDMA (MC_FORCE_TCP=1 keeps it on TCP)",
                protocol,
            )
        return found
    devices = f" named by device_name={device_name!r}" if device_name else ""
    why = (
        "MC_FORCE_TCP is set"
        if (environment.mooncake_force_tcp() if force_tcp is None else force_tcp)
        else f"Mooncake finds no RDMA device{devices} on this host"
    )
    if protocol == "rdma":
        raise TransportError(
            f'MooncakeConfig(protocol="rdma"): {why} (no RDMA device it can use), so it '
            f'would write over TCP. Set MooncakeConfig(protocol="tcp") to write over TCP, '
            f'or protocol="auto" to take RDMA where there is a device and TCP elsewhere; '
            f"`p2pweights doctor` lists this host's RDMA devices"
        )
    logger.warning("MooncakeConfig(protocol=%r): %s; writing over TCP", protocol, why)
    return found


def _local_topology(device_name: str) -> str:
    TransferEngine = _transfer_engine_class()
    try:
        return str(TransferEngine().get_local_topology(device_name))
    except Exception as exc:  # the binding's own errors: say where they came from
        raise TransportError(
            f"Mooncake's discovery of this host's RDMA devices failed ({exc!r}); "
            f'MooncakeConfig(protocol="tcp") with MC_FORCE_TCP=1 keeps Mooncake off them'
        ) from exc


def _transfer_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportError(
            f"cannot import mooncake ({exc}); pip install mooncake-transfer-engine "
            f"(or -non-cuda on CPU hosts) and the system packages libibverbs1 librdmacm1"
        ) from exc
    return TransferEngine


def _new_engine(hostname: str, protocol: str, device_name: str) -> Any:
    """A Mooncake ``TransferEngine`` (``protocol`` is passed on, as sglang does; Mooncake
    picks what ``installed_protocol`` says)."""
    logs.apply_log_level()
    environment.quiet_mooncake_logs()
    engine = _transfer_engine_class()()
    ret = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
    if ret != 0:
        raise TransportError(
            f"Mooncake TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, "
            f"{device_name!r}) returned {ret}; check the hostname is this host's address and, "
            f"for protocol 'rdma', that the device exists"
        )
    return engine


def _describe(index: int, write: Write, reason: str) -> str:
    return (
        f"write #{index} (src 0x{write.src_address:x} -> dst 0x{write.dst_address:x}, "
        f"{write.num_bytes} bytes): {reason}"
    )


class MooncakeTransport(Transport):
    """Trainer side: one ``TransferEngine`` per process, writing into engines' published memory."""

    name = "mooncake"

    def __init__(self, config: MooncakeConfig) -> None:
        self._config = config
        self._protocol = choose_protocol(config.protocol, config.device_name, _local_topology)
        self._engine = _new_engine(config.local_hostname, self._protocol, config.device_name)
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []
        self._local = RegionIndex([])
        self._peers: set[str] = set()
        # Batches writes gave up on that had not ended: their memory stays registered.
        self._given_up = GivenUp("Mooncake", "engine", "write")

    @property
    def protocol(self) -> str:
        """ "rdma" or "tcp": what Mooncake writes over (also under protocol="auto")."""
        return self._protocol

    @property
    def session_id(self) -> str:
        """This transport's own Mooncake session id (``host:rpc_port``)."""
        return f"{self._config.local_hostname}:{self._engine.get_rpc_port()}"

    def register(self, buffer: torch.Tensor) -> None:
        address, num_bytes = source_region(buffer)
        with self._lock:
            if self._local.covers(address, num_bytes):
                return
            ret = self._engine.register_memory(address, num_bytes)
            if ret != 0:
                raise TransportError(
                    f"Mooncake register_memory(0x{address:x}, {num_bytes}) returned {ret}; "
                    f"with RDMA, check the memlock limit (ulimit -l) and the device"
                )
            self._registered.append((address, num_bytes))
            self._local = RegionIndex(self._registered)

    def unregister(self, buffer: torch.Tensor) -> None:
        address = buffer.data_ptr()
        with self._lock:
            if not any(a == address for a, _ in self._registered):
                return
            if self._given_up.keep_registered(buffer):
                return
            self._engine.unregister_memory(address)
            self._registered = [r for r in self._registered if r[0] != address]
            self._local = RegionIndex(self._registered)

    def connect(self, target: RankPublication) -> None:
        # Mooncake opens the peer's segment (its handshake) on the first write to it; the
        # binding has no safe way to open one ahead, so a dead peer surfaces in write().
        require_backend(target, "mooncake", usable=bool(target.session_id))
        assert target.session_id is not None
        with self._lock:
            self._peers.add(target.session_id)

    def disconnect(self, target: RankPublication) -> None:
        # The binding cannot close a peer's segment; forgetting it here means no write
        # goes to it unless it is connected again (the executor only writes what it
        # connected, from a byte plan checked against the current publications).
        with self._lock:
            self._peers.discard(target.session_id or "")

    @property
    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._peers)

    def write(self, target: RankPublication, writes: Sequence[Write], timeout_s: float) -> None:
        self.connect(target)
        # bounds: every destination was checked against the publication in the byte plan
        deadline = time.monotonic() + timeout_s
        session = target.peer
        pending: dict[int, int] = {}  # batch id -> index into writes
        failures: list[str] = []
        slow: set[int] = set()  # writes Mooncake reported timed out: still in flight
        try:
            for i, w in enumerate(writes):
                batch_id = self._engine.transfer_submit_write(
                    session, w.src_address, w.dst_address, w.num_bytes
                )
                if batch_id in _SUBMIT_FAILED:
                    failures.append(_describe(i, w, "Mooncake refused to submit it"))
                    break  # the peer is unreachable; the rest would fail the same way
                pending[batch_id] = i
        except Exception as exc:  # the binding raised: what it started may still land
            failures.append(f"submitting write #{len(pending)} raised {exc!r}")
            if pending:
                raise self._unsettled(target, writes, failures, pending, slow, timeout_s) from exc
            raise TransferError(self._message(target, writes, failures)) from exc

        def all_ended() -> bool:
            for batch_id, i in list(pending.items()):
                status = self._engine.transfer_check_status(batch_id)
                if status == _PENDING:
                    continue
                if status == _TIMED_OUT:
                    slow.add(i)
                    continue
                del pending[batch_id]  # ended (and its descriptor freed by the binding)
                if status != _DONE:
                    failures.append(_describe(i, writes[i], "failed"))
            return not pending

        try:
            poll_transfers(all_ended, deadline)
        except Exception as exc:  # the binding raised: the batches not seen ended may land
            failures.append(f"asking Mooncake for a write's status raised {exc!r}")
            if pending:
                raise self._unsettled(target, writes, failures, pending, slow, timeout_s) from exc
            raise TransferError(self._message(target, writes, failures)) from exc
        if pending:
            raise self._unsettled(target, writes, failures, pending, slow, timeout_s)
        if failures:
            raise TransferError(self._message(target, writes, failures))

    def _unsettled(
        self,
        target: RankPublication,
        writes: Sequence[Write],
        failures: list[str],
        pending: dict[int, int],
        slow: set[int],
        timeout_s: float,
    ) -> UnsettledWrite:
        late = [
            _describe(
                i,
                writes[i],
                f"not done after {timeout_s:g} s"
                + (" (Mooncake reports it timed out)" if i in slow else ""),
            )
            for i in pending.values()
        ]
        batches = _PendingBatches(
            self._engine,
            list(pending),
            [(writes[i].src_address, writes[i].num_bytes) for i in pending.values()],
        )
        with self._lock:
            self._given_up.add(batches)
        return UnsettledWrite(
            f"{self._message(target, writes, failures + late)}; {len(pending)} of them are "
            f"still in flight and may land later, so this engine rank stays torn until they "
            f"ended",
            batches.settle,
        )

    def _message(
        self, target: RankPublication, writes: Sequence[Write], problems: list[str]
    ) -> str:
        return (
            f"{where(target.engine_url, target.engine_rank)} (Mooncake session "
            f"{target.session_id}): {len(problems)} of {len(writes)} writes did not complete: "
            f"{some_of(problems, limit=3)}; check that the engine is "
            f"alive and re-fetch its published addresses if it restarted"
        )

    def close(self) -> None:
        with self._lock:
            # its worker threads may still move the bytes of writes given up on: then
            # neither the engine nor the memory it reads may go
            engine, registered = self._engine, self._registered
            if not self._given_up.keep_at_close(engine, lambda: self.session_id, registered):
                for address, _ in registered:
                    self._engine.unregister_memory(address)
            self._registered = []
            self._local = RegionIndex([])


class _PendingBatches(InFlight):
    """Mooncake batches a write gave up on, polled until each completed or failed."""

    def __init__(self, engine: Any, batch_ids: list[int], sources: list[tuple[int, int]]):
        super().__init__(sources)
        self._engine = engine
        self._batch_ids = batch_ids

    def _poll(self) -> bool:
        # a batch that ended is freed by transfer_check_status: never asked again
        kept = []
        for batch_id in self._batch_ids:
            try:
                status = self._engine.transfer_check_status(batch_id)
            except Exception:  # no verdict from the binding: it may still land
                status = _PENDING
            if status in (_PENDING, _TIMED_OUT):
                kept.append(batch_id)
        self._batch_ids = kept
        return not self._batch_ids


class MooncakePublisher(Publisher):
    """Engine side: registers one rank's weights and publishes them as sglang does."""

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        engine_rank: int = 0,
    ) -> None:
        self.engine_rank = engine_rank
        self._engine = _new_engine(hostname, protocol, device_name)
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[tuple[int, int]] = []
        self._index = RegionIndex([])

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        for address, num_bytes in merged_regions(tensors.values()):
            if self._index.covers(address, num_bytes):
                continue
            ret = self._engine.register_memory(address, num_bytes)
            if ret != 0:
                raise TransportError(
                    f"Mooncake register_memory(0x{address:x}, {num_bytes}) returned {ret}"
                )
            self._registered.append((address, num_bytes))
        self._index = RegionIndex(self._registered)

    def publication(self, tensors: dict[str, torch.Tensor]) -> list[Any]:
        """``[session_id, {name: [data_ptr, numel, element_size]}]``, sglang's Mooncake form."""
        return [self.session_id, weights_info(tensors, self._index)]

    def close(self) -> None:
        for address, _ in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
        self._index = RegionIndex([])
