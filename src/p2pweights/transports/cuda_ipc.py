"""Writes into engines on the trainer's own host through CUDA IPC: device copies over NVLink.

Engine side, ``CudaIpcPublisher``: each block of a rank's GPU weights is shared by the
IPC handle of the device allocation holding it, published with the block's address in
the engine process, the GPU it lives on and the host it runs on.

Trainer side, ``CudaIpcTransport``: at connect, every published allocation is opened
once, in the context of the trainer's own GPU (``CudaIpcConfig.device``) with lazy peer
access; that choice is the whole speed difference (see ``cuda_runtime``). A write is a
run of ``cudaMemcpyAsync`` calls on the calling writer thread's own stream, all queued
before one wait, so each engine rank has its copies in flight together while other
ranks' writers queue theirs on their own streams. Writes that touch end to end in both
source and destination (consecutive parameters of one staging block landing in
consecutive engine parameters) are merged into one copy.

An engine on another host cannot be reached this way; ``connect`` refuses it, naming
the engine, before any byte moves. Without CUDA in the trainer the transport refuses
to start, and an engine publishes only GPU memory. Those refusals are all that can be
tested on a host without a GPU.
"""

from __future__ import annotations

import base64
import bisect
import functools
import itertools
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2pweights.config import CudaIpcConfig
from p2pweights.errors import ConfigError, TransferError, TransportError, UnsettledWrite
from p2pweights.polling import poll_until
from p2pweights.transports.base import (
    InFlight,
    Publisher,
    Transport,
    Write,
)
from p2pweights.transports.cuda_runtime import CudaRuntime, cuda_runtime
from p2pweights.transports.regions import (
    RegionIndex,
    RegisteredRegions,
    merged_regions,
    weights_info,
)
from p2pweights.wire.publication import IpcSegment, RankPublication, require_backend

_POLL_S = 20e-6
"""How long a writer sleeps between polls of its copies' completion event."""


@functools.cache
def host_id() -> str:
    """This host as engines and trainers compare it: hostname and kernel boot id."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.exists() else "no-boot-id"
    return f"{socket.gethostname()}/{boot_id}"


def check_reachable(target: RankPublication, local_host: str) -> None:
    """Refuse a publication CUDA IPC cannot write: another transport's, or another host's."""
    require_backend(target, "cuda_ipc")
    if target.host_id != local_host:
        raise ConfigError(
            f"{target.where} runs on host {target.host_id}, not on this trainer's host "
            f"{local_host}; CudaIpcConfig reaches engines on the trainer's own host only. "
            f"Use MooncakeConfig or NixlConfig for engines on other hosts"
        )


@dataclass(frozen=True)
class Opened:
    """One engine publication's allocations, mapped into this process."""

    segments: tuple[tuple[int, int, int], ...]
    """(start, end) in the engine and the start's address here, sorted; never merged:
    two segments adjacent in the engine may be mapped far apart here."""
    mapped: tuple[int, ...]
    """The pointers ``cudaIpcOpenMemHandle`` returned (closed on disconnect)."""
    starts: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "starts", tuple(start for start, _, _ in self.segments))

    def locate(self, target: RankPublication, address: int, num_bytes: int) -> int:
        """Index of the one segment holding ``[address, address + num_bytes)``; refuses
        bytes outside one segment ``target`` published."""
        index = bisect.bisect_right(self.starts, address) - 1
        if index < 0 or num_bytes <= 0 or address + num_bytes > self.segments[index][1]:
            raise TransferError(
                f"a write of {num_bytes} bytes at {address:#x} is not inside one block of "
                f"the memory {target.where} published; nothing was written"
            )
        return index


class CudaIpcTransport(Transport):
    """Trainer side: device copies into engine memory opened by CUDA IPC handle."""

    name = "cuda_ipc"

    @property
    def protocol(self) -> str:
        return "device copy"

    def __init__(self, config: CudaIpcConfig) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(
                "CudaIpcConfig needs a CUDA device in the trainer process (none is visible); "
                "use MooncakeConfig or NixlConfig on hosts without GPUs"
            )
        self._device = torch.cuda.current_device() if config.device is None else config.device
        if not 0 <= self._device < torch.cuda.device_count():
            raise ConfigError(
                f"CudaIpcConfig.device={self._device}, but this process sees "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
        self._cuda: CudaRuntime = cuda_runtime()
        self._host = host_id()
        self._sources = RegisteredRegions()
        self._opened: dict[str, Opened] = {}
        # Each engine rank's last copies: waited for before its memory or a buffer goes.
        self._pending: dict[str, torch.cuda.Event] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        # (peer, segment index) -> the mapped segment as a tensor, None if not on our GPU.
        self._direct: dict[tuple[str, int], torch.Tensor | None] = {}
        self._direct_allowed = config.direct

    @property
    def device(self) -> int:
        """The trainer GPU whose context opens the engines' memory and issues the copies."""
        return self._device

    def register(self, buffer: torch.Tensor) -> None:
        address, num_bytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        with self._lock:
            self._sources.add(address, num_bytes)

    def unregister(self, buffer: torch.Tensor) -> None:
        self._settle()  # the buffer is freed next: no copy may still read it
        with self._lock:
            self._sources.remove(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    @property
    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._opened)

    def connect(self, target: RankPublication) -> None:
        check_reachable(target, self._host)
        with self._lock:
            if target.peer in self._opened:
                return
        check_segments(target)
        mapped: dict[bytes, int] = {}
        try:
            spans = self._open(target, mapped)
            check_mapped(target, spans)
        except TransportError:
            self._close_pointers(tuple(mapped.values()))
            raise
        segments = [
            (segment.address, segment.end, mapped[segment.handle] + segment.offset)
            for segment in target.segments
        ]
        opened = Opened(tuple(sorted(segments)), tuple(mapped.values()))
        with self._lock:
            self._opened[target.peer] = opened

    def _open(self, target: RankPublication, mapped: dict[bytes, int]) -> dict[bytes, int]:
        """Open each allocation ``target`` published once (into ``mapped``: handle ->
        pointer here, for the caller to close on failure); returns each handle's bytes
        mapped from its pointer on, as the driver reports them."""
        spans = {}
        try:
            for segment in target.segments:
                if segment.handle in mapped:
                    continue
                pointer = self._cuda.open_ipc_handle(segment.handle, self._device)
                mapped[segment.handle] = pointer
                with self._cuda.on_device(self._device):
                    base, size = self._cuda.allocation_range(pointer)
                spans[segment.handle] = base + size - pointer
        except TransportError as exc:
            raise TransportError(f"cannot open the memory {target.where} published: {exc}") from exc
        return spans

    def direct_view(
        self, target: RankPublication, address: int, num_bytes: int
    ) -> torch.Tensor | None:
        """Engine memory on this transport's own GPU (colocated training and rollout): a
        tensor over the mapping, so the loaders copy into it as into a staging buffer.
        Memory on another GPU stays written through staging: torch would copy into it
        from that GPU's context, the slow path of ``cuda_runtime``'s finding."""
        if not self._direct_allowed:
            return None
        opened = self._opened_for(target)
        index = opened.locate(target, address, num_bytes)
        with self._lock:
            if self._opened.get(target.peer) is not opened:
                raise TransferError(f"{target.where} was disconnected while being written")
            key = (target.peer, index)
            if key not in self._direct:
                start, end, local = opened.segments[index]
                on_ours = self._cuda.pointer_device(local) == self._device
                self._direct[key] = _alias(local, end - start, self._device) if on_ours else None
            segment = self._direct[key]
        if segment is None:
            return None
        offset = address - opened.segments[index][0]
        return segment[offset : offset + num_bytes]

    def disconnect(self, target: RankPublication) -> None:
        with self._lock:
            opened = self._opened.pop(target.peer, None)
            pending = self._pending.pop(target.peer, None)
            # views over the mapping must go before it is closed
            self._direct = {k: v for k, v in self._direct.items() if k[0] != target.peer}
        if pending is not None:
            pending.synchronize()  # copies given up on still read and write this memory
        if opened is not None:
            self._close_pointers(opened.mapped)

    def _close_pointers(self, pointers: tuple[int, ...]) -> None:
        with self._cuda.on_device(self._device):
            for pointer in pointers:
                self._cuda.close_ipc_handle(pointer)

    def _settle(self) -> None:
        """Wait for every copy issued so far (a timed-out write's copies keep running)."""
        with self._lock:
            pending = list(self._pending.values())
        for event in pending:
            event.synchronize()

    def _opened_for(self, target: RankPublication) -> Opened:
        with self._lock:
            opened = self._opened.get(target.peer)
        if opened is None:
            raise TransferError(f"{target.where} is not connected; connect() it first")
        return opened

    def write(self, target: RankPublication, writes: Sequence[Write], timeout_s: float) -> None:
        opened = self._opened_for(target)
        with self._lock:
            sources = self._sources.index
        copies = merge_adjacent([translate(target, opened, sources, w) for w in writes])
        stream = self._stream()
        issued = 0
        failed: Exception | None = None
        # the runtime's current device is per thread
        with self._cuda.on_device(self._device):
            try:
                for copy in copies:
                    self._cuda.copy_async(
                        copy.dst_address, copy.src_address, copy.num_bytes, stream.cuda_stream
                    )
                    issued += 1
            except Exception as exc:  # the copies issued before it still run
                failed = exc
            done = torch.cuda.Event()
            done.record(stream)  # after every copy issued: waited for before memory goes
        with self._lock:
            self._pending[target.peer] = done
        if failed is not None:
            running = PendingCopies(done, [(c.src_address, c.num_bytes) for c in copies[:issued]])
            message = (
                f"copy {issued + 1} of {len(copies)} to {target.where} failed to start: {failed!r}"
            )
            if not issued:
                raise TransferError(message) from failed
            raise UnsettledWrite(
                f"{message}; the {issued} copies issued before it cannot be cancelled, so "
                f"this engine rank stays torn until they finished",
                running.settle,
            ) from failed
        deadline = time.monotonic() + timeout_s
        if not poll_until(done.query, deadline, sleep_s=_POLL_S):
            # A device copy cannot be cancelled: the stream drains on its own, and
            # until it did the copies read the staging buffer and write the engine.
            running = PendingCopies(done, [(c.src_address, c.num_bytes) for c in copies])
            raise UnsettledWrite(
                f"{len(copies)} copies to {target.where} still running after {timeout_s} s; "
                f"a device copy cannot be cancelled, so this engine rank stays torn until "
                f"they finished",
                running.settle,
            )

    def _stream(self) -> torch.cuda.Stream:
        """The calling writer thread's own stream on the trainer's device."""
        stream: torch.cuda.Stream | None = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self._device)
        return stream

    def close(self) -> None:
        self._settle()
        with self._lock:
            opened, self._opened = list(self._opened.values()), {}
            self._pending = {}
            self._direct = {}
            self._sources.clear()
        for entry in opened:
            self._close_pointers(entry.mapped)


class PendingCopies(InFlight):
    """Device copies a write gave up on, until their completion event fired."""

    def __init__(self, done: Any, sources: list[tuple[int, int]]):
        super().__init__(sources)
        self._done = done

    def _poll(self) -> bool:
        return bool(self._done.query())


def _alias(pointer: int, num_bytes: int, device: int) -> torch.Tensor | None:
    """A tensor over mapped memory on ``device``, or None if torch would not alias it:
    loads must fill the engine's memory, never a copy (``as_tensor`` copies to the default
    device when one is set and differs, so that is set here, and the result checked)."""
    with torch.device("cuda", device):  # as_tensor takes the default device as its own
        mapped = torch.as_tensor(_MappedBytes(pointer, num_bytes))
    if mapped.data_ptr() != pointer or mapped.device != torch.device("cuda", device):
        return None
    return mapped


class _MappedBytes:
    """Device memory mapped here, as ``torch.as_tensor`` takes it (the CUDA array
    interface; torch asks the runtime which GPU it is on)."""

    def __init__(self, pointer: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


def translate(target: RankPublication, opened: Opened, sources: RegionIndex, write: Write) -> Write:
    """The write with its destination as mapped here, and its segment as ``dst_device``
    (so only copies within one mapping merge); refuses bytes outside one published
    segment or outside the registered staging buffers."""
    index = opened.locate(target, write.dst_address, write.num_bytes)
    if not sources.covers(write.src_address, write.num_bytes):
        raise TransferError(
            f"a write's source {write.src_address:#x} (+{write.num_bytes}) is not in a "
            f"registered staging buffer"
        )
    start, _, local = opened.segments[index]
    return Write(write.src_address, local + write.dst_address - start, write.num_bytes, index)


def check_segments(target: RankPublication) -> None:
    """Refuse segments no allocation could hold before opening any of them: empty or
    negative, overlapping, or of one handle but disagreeing on where its allocation
    starts in the engine (``address - offset``); and parameters outside every segment."""
    bases: dict[bytes, int] = {}
    for segment in target.segments:
        if segment.num_bytes <= 0 or segment.offset < 0 or segment.address <= 0:
            raise TransportError(
                f"{target.where} published an impossible CUDA IPC segment {segment}"
            )
        base = bases.setdefault(segment.handle, segment.address - segment.offset)
        if segment.address - segment.offset != base:
            raise TransportError(
                f"{target.where} published CUDA IPC segments of one allocation (one handle) "
                f"that disagree on where it starts: {base:#x} and "
                f"{segment.address - segment.offset:#x} (address - offset); nothing was "
                f"opened or written"
            )
    ordered = sorted(target.segments, key=lambda s: s.address)
    for before, after in itertools.pairwise(ordered):
        if after.address < before.end:
            raise TransportError(f"{target.where} published overlapping CUDA IPC segments")
    for name, region in target.regions.items():
        if not any(s.address <= region.address and region.end <= s.end for s in ordered):
            raise TransportError(
                f"{target.where} published parameter {name!r} outside its CUDA IPC segments"
            )


def check_mapped(target: RankPublication, spans: Mapping[bytes, int]) -> None:
    """Refuse a segment that runs past the allocation its handle opened here: ``spans``
    gives, per handle, the bytes mapped from the pointer it opened at on (the driver's
    size of that allocation). A publication is the engine's word; the mapping is the
    driver's, and every copy must stay inside it."""
    for segment in target.segments:
        mapped = spans[segment.handle]
        if segment.offset + segment.num_bytes > mapped:
            raise TransportError(
                f"{target.where} published a CUDA IPC segment of {segment.num_bytes} bytes at "
                f"offset {segment.offset:#x} of its allocation (ending at "
                f"{segment.offset + segment.num_bytes:#x}), but the allocation its handle "
                f"opened here has {mapped:#x} bytes; nothing was written. The engine's "
                f"publication does not describe its memory: restart it, or report a bug"
            )


def merge_adjacent(writes: Sequence[Write]) -> list[Write]:
    """Writes in order, each run that continues the last in source and destination merged."""
    merged: list[Write] = []
    for write in writes:
        if merged:
            last = merged[-1]
            if (
                last.src_address + last.num_bytes == write.src_address
                and last.dst_address + last.num_bytes == write.dst_address
                and last.dst_device == write.dst_device
            ):
                merged[-1] = Write(
                    last.src_address,
                    last.dst_address,
                    last.num_bytes + write.num_bytes,
                    last.dst_device,
                )
                continue
        merged.append(write)
    return merged


class CudaIpcPublisher(Publisher):
    """Engine side: shares one rank's GPU weight blocks by CUDA IPC handle."""

    def __init__(self, engine_rank: int = 0) -> None:
        self._name = f"cuda_ipc_weight_tp{engine_rank}_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        self._segments: list[IpcSegment] = []
        self._index = RegionIndex([])
        self._device = 0

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        devices = {t.device for t in tensors.values()}
        if any(d.type != "cuda" for d in devices):
            raise ConfigError(
                f"CUDA IPC shares GPU memory only; these weights live on "
                f"{sorted(map(str, devices))}. Start the engine on a GPU "
                f"(--device cuda:N) or publish with mooncake or nixl"
            )
        cuda = cuda_runtime()
        self._device = next(iter(devices)).index or 0
        with cuda.on_device(self._device):  # the driver calls need this GPU's context
            for address, num_bytes in merged_regions(tensors.values()):
                if self._index.covers(address, num_bytes):
                    continue
                self._segments.extend(_segments_of(cuda, address, num_bytes, self._device))
                self._index = RegionIndex([*self._index.regions, (address, num_bytes)])

    def publication(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {
            "backend": "cuda_ipc",
            "agent_name": self._name,
            "host_id": host_id(),
            "segments": [
                {
                    "address": s.address,
                    "num_bytes": s.num_bytes,
                    "gpu_id": s.gpu_id,
                    "handle": base64.b64encode(s.handle).decode("ascii"),
                    "offset": s.offset,
                }
                for s in self._segments
            ],
            "weights_info_dict": weights_info(tensors, self._index, self._device),
        }

    def close(self) -> None:
        # Handles need no release on the exporting side; the memory is the engine's.
        self._segments.clear()
        self._index = RegionIndex([])


def _segments_of(cuda: CudaRuntime, address: int, num_bytes: int, gpu_id: int) -> list[IpcSegment]:
    """One segment per device allocation the region ``[address, address + num_bytes)`` spans
    (a merged region may cover adjacent allocations, each with its own handle)."""
    segments = []
    end = address + num_bytes
    while address < end:
        base, size = cuda.allocation_range(address)
        stop = min(end, base + size)
        segments.append(
            IpcSegment(address, stop - address, gpu_id, cuda.ipc_handle(base), address - base)
        )
        address = stop
    return segments
