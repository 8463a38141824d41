"""What one engine rank publishes about its weights: where the bytes live and how to reach them.

sglang's ``/remote_instance_transfer_engine_info?rank=R`` answers, for Mooncake::

    {"rank": R, "remote_instance_transfer_engine_info": [session_id, {name: [ptr, numel, elsize]}]}

and, with NIXL publishing (sglang PR #35712 or the p2pweights plugin), the second
element is a dict ``{"backend": "nixl", "agent_name", "agent_metadata" (base64),
"weights_info_dict": {name: [ptr, numel, elsize, gpu_id]}}``; Mooncake may also
come as ``{"backend": "mooncake", "session_id", "weights_info_dict"}``. An engine on
the trainer's host may publish CUDA IPC handles (``CudaIpcPublisher``):
``{"backend": "cuda_ipc", "agent_name", "host_id", "segments": [{"address",
"num_bytes", "gpu_id", "handle" (base64), "offset"}], "weights_info_dict"}``.

A publication in dict form may say ``"live": true`` with an ``"epoch"`` number (the
p2pweights sglang plugin does): its publisher checks after every
``begin_weight_update`` and ``end_weight_update`` that each parameter still lives
where it was published, and publishes afresh, with the next epoch, when the engine's
processing replaced a parameter's storage (sglang's CPU AMX weight packing does, after
every load). Writers re-read a live publication once its engine's update session is
open, before any write (``WeightSyncSession``). sglang's own Mooncake publication is
taken once at start-up and never says ``live``.

A dict publication saying ``"write_digests": true`` comes from an engine rank that
records, before every ``end_weight_update``, a digest of each published parameter
(``p2pweights.engine_side``), read with ``EngineClient.write_digests``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from p2pweights.errors import EngineError


@dataclass(frozen=True)
class WeightRegion:
    """One parameter's bytes in engine memory."""

    address: int
    num_bytes: int
    gpu_id: int | None = None

    @property
    def end(self) -> int:
        return self.address + self.num_bytes


@dataclass(frozen=True)
class IpcSegment:
    """A block of an engine rank's GPU memory, shared by CUDA IPC handle."""

    address: int
    """The block's first byte, in the engine process's address space."""
    num_bytes: int
    gpu_id: int
    handle: bytes = field(repr=False)
    """``cudaIpcMemHandle_t`` of the device allocation holding the block."""
    offset: int
    """Where the block starts in that allocation."""

    @property
    def end(self) -> int:
        return self.address + self.num_bytes


@dataclass(frozen=True)
class RankPublication:
    """The weight regions and transport handle one engine rank published."""

    engine_url: str
    engine_rank: int
    backend: str  # "mooncake", "nixl" or "cuda_ipc"
    regions: dict[str, WeightRegion] = field(repr=False)
    session_id: str | None = None  # mooncake: "host:rpc_port"
    agent_name: str | None = None  # nixl; cuda_ipc: the publisher's unique name
    agent_metadata: bytes | None = field(default=None, repr=False)  # nixl
    mem_type: str | None = None  # nixl: "VRAM" or "DRAM" when the publisher says
    role: str = "target"
    """The rank's model runner: "target", or "draft" (a same-model speculative draft)."""
    host_id: str | None = None  # cuda_ipc: the engine's host (hostname and boot id)
    segments: tuple[IpcSegment, ...] = field(default=(), repr=False)  # cuda_ipc
    live: bool = False
    """The publisher publishes afresh when the engine moves a parameter (see above)."""
    epoch: int = 0
    """How many times a live publisher has published afresh."""
    write_digests: bool = False
    """The rank records write digests before each ``end_weight_update`` (see above)."""

    @property
    def where(self) -> str:
        """``engine URL rank R`` (and the runner, for a draft), for messages."""
        runner = "" if self.role == "target" else f" ({self.role})"
        return f"engine {self.engine_url} rank {self.engine_rank}{runner}"

    @property
    def peer(self) -> str:
        """The transport-level name of this rank (Mooncake session id or NIXL agent name)."""
        peer = self.session_id if self.backend == "mooncake" else self.agent_name
        assert peer is not None
        return peer


def parse_publication(engine_url: str, engine_rank: int, body: dict[str, Any]) -> RankPublication:
    """Parse sglang's JSON answer for one rank; raise ``EngineError`` naming what is wrong."""
    info = body.get("remote_instance_transfer_engine_info")
    if info is None:
        raise EngineError(
            f"engine {engine_url} rank {engine_rank}: answer has no "
            f"'remote_instance_transfer_engine_info'; start sglang with "
            f"--remote-instance-weight-loader-start-seed-via-transfer-engine (Mooncake) "
            f"or the p2pweights NIXL plugin"
        )
    try:
        if isinstance(info, list) and len(info) == 2:
            session_id, table = info
            return RankPublication(
                engine_url, engine_rank, "mooncake", _regions(table), session_id=str(session_id)
            )
        if not isinstance(info, dict):
            raise TypeError(f"expected a [session_id, table] pair or an object, got {info!r:.80}")
        backend = info.get("backend", "mooncake")
        table = info["weights_info_dict"]
        live, epoch = bool(info.get("live", False)), int(info.get("epoch", 0))
        digests = bool(info.get("write_digests", False))
        if backend == "mooncake":
            return RankPublication(
                engine_url,
                engine_rank,
                "mooncake",
                _regions(table),
                session_id=str(info["session_id"]),
                live=live,
                epoch=epoch,
                write_digests=digests,
            )
        if backend == "nixl":
            return RankPublication(
                engine_url,
                engine_rank,
                "nixl",
                _regions(table),
                agent_name=str(info["agent_name"]),
                agent_metadata=base64.b64decode(info["agent_metadata"]),
                mem_type=info.get("mem_type"),
                live=live,
                epoch=epoch,
                write_digests=digests,
            )
        if backend == "cuda_ipc":
            return RankPublication(
                engine_url,
                engine_rank,
                "cuda_ipc",
                _regions(table),
                agent_name=str(info["agent_name"]),
                host_id=str(info["host_id"]),
                segments=tuple(_segment(s) for s in info["segments"]),
                live=live,
                epoch=epoch,
                write_digests=digests,
            )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"engine {engine_url} rank {engine_rank}: malformed weight publication ({exc!r})"
        ) from exc
    raise EngineError(
        f"engine {engine_url} rank {engine_rank}: unknown published backend {backend!r}"
    )


IPC_HANDLE_BYTES = 64
"""Size of a ``cudaIpcMemHandle_t``."""


def _segment(entry: dict[str, Any]) -> IpcSegment:
    handle = base64.b64decode(entry["handle"], validate=True)
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    return IpcSegment(
        address=int(entry["address"]),
        num_bytes=int(entry["num_bytes"]),
        gpu_id=int(entry["gpu_id"]),
        handle=handle,
        offset=int(entry["offset"]),
    )


def _regions(table: dict[str, list[int]]) -> dict[str, WeightRegion]:
    regions = {}
    for name, entry in table.items():
        address, numel, element_size = (int(x) for x in entry[:3])
        gpu_id = int(entry[3]) if len(entry) > 3 else None
        regions[name] = WeightRegion(address, numel * element_size, gpu_id)
    return regions
