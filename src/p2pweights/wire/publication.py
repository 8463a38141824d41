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

A dict publication saying ``"error": "<why>"`` (and perhaps nothing else but its
``backend``) is an engine rank's word that it could not publish, or withdrew what it
published (the p2pweights plugin's CUDA IPC publication on a CPU server, or after its
weights moved and could not be published afresh): ``parse_publication`` refuses it with
that reason, so no writer uses an earlier publication of the rank.

A dict publication saying ``"write_digests": true`` comes from an engine rank that
records, before every ``end_weight_update``, a digest of each published parameter
(``p2pweights.engine_side.steps``), read with ``EngineClient.write_digests``.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pweights.errors import EngineError
from p2pweights.report import EngineRankKey
from p2pweights.transport_registry import publication_backends as registered_backends
from p2pweights.wire.delta import HEADER_BYTES, SCRATCH_NAME

DIGESTS_ROLE = "p2pweights-digests"
"""The ``role`` a rank's record of write digests is published under, next to its weight
publication (``?rank=R&role=p2pweights-digests``: the local engine's route, the plugin's
bootstrap server)."""


_INFO_KEY = "remote_instance_transfer_engine_info"
"""Where sglang's publication route answers a rank's info; a digest record answers there too."""


def digest_answer(rank: int, record: Mapping[str, Any]) -> dict[str, Any]:
    """The answer to ``?rank=R&role=p2pweights-digests``: rank R's write-digest record
    (the local engine's route, the p2pweights plugin's bootstrap server)."""
    return {"rank": rank, "role": DIGESTS_ROLE, _INFO_KEY: record}


def is_digest_answer(body: Mapping[str, Any]) -> bool:
    """Whether an answer to ``?role=p2pweights-digests`` is a digest answer (sglang's own
    route forwards only the rank and answers the rank's publication)."""
    return body.get("role") == DIGESTS_ROLE


def digest_record(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record in a digest answer (``digest_answer``); None where ``body`` is not one
    or carries no record object."""
    record = body.get(_INFO_KEY)
    return record if is_digest_answer(body) and isinstance(record, dict) else None


END_RECORDS_KEY = "p2pweights_end_records"
"""Where an ``end_weight_update`` answer carries the records its ranks took before that
end: a list of ``{"rank": R, "runner": "target" | "draft", "record": {...}}`` (the
local engine; the same records ``?role=p2pweights-digests`` serves)."""


def end_record(rank: int, runner: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """One entry of an end answer's ``END_RECORDS_KEY`` list (read back by ``end_records``)."""
    return {"rank": rank, "runner": runner, "record": record}


def end_records(listed: Any) -> dict[tuple[int, str], dict[str, Any]]:
    """(engine rank, runner) -> record, from an end answer's ``END_RECORDS_KEY`` (None:
    the engine sent none). An engine's answer is untrusted: anything but a list of
    entries of an int rank, a runner name and an object, each (rank, runner) once, is
    refused (``ValueError``, saying what was wrong without the records themselves)."""
    if listed is None:
        return {}
    if not isinstance(listed, list):
        raise ValueError(f"not a list but {type(listed).__name__}")
    found: dict[tuple[int, str], dict[str, Any]] = {}
    for i, entry in enumerate(listed):
        if not isinstance(entry, dict):
            raise ValueError(f"entry {i} is {type(entry).__name__}, not an object")
        rank, runner, record = entry.get("rank"), entry.get("runner"), entry.get("record")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"entry {i}: rank {str(rank)[:40]!r} is not an int >= 0")
        if not isinstance(runner, str) or not isinstance(record, dict):
            raise ValueError(
                f"entry {i} (rank {rank}): runner {type(runner).__name__} and record "
                f"{type(record).__name__}, expected str and object"
            )
        if (rank, runner) in found:
            raise ValueError(f"rank {rank} runner {runner[:40]!r} appears twice")
        found[(rank, runner)] = record
    return found


@dataclass(frozen=True, eq=False)
class Runner:
    """One model runner of an engine rank: what writes, deltas and digests are filed under
    (``RankPublication.runner``). It replaced the tuple ``(engine_url, engine_rank, role)``
    and still behaves as one: it unpacks, and equals, hashes and sorts as that tuple."""

    engine_url: str
    engine_rank: int
    role: str
    """"target", or "draft" (the rank's speculative draft runner)."""

    @property
    def key(self) -> EngineRankKey:
        """The engine rank this runner is of."""
        return EngineRankKey(self.engine_url, self.engine_rank)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.engine_url, self.engine_rank, self.role))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Runner | tuple):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.engine_url, self.engine_rank, self.role))

    def __lt__(self, other: Runner | tuple[str, int, str]) -> bool:
        return tuple(self) < tuple(other)

    def __gt__(self, other: Runner | tuple[str, int, str]) -> bool:
        return tuple(self) > tuple(other)


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
    backend: str  # "mooncake", "nixl", "cuda_ipc", or a registered transport's
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
    digest_scheme: str | None = None
    """How it digests (``wire.digest.SCHEME`` of its p2pweights); None where it does
    not say (a release before the scheme was published)."""
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """For a registered transport's own backend (``transport_registry``): everything its
    publisher published for the rank, for its ``Transport`` to read."""

    @property
    def where(self) -> str:
        """``engine URL rank R`` (and the runner, for a draft), for messages."""
        runner = "" if self.role == "target" else f" ({self.role})"
        return f"engine {self.engine_url} rank {self.engine_rank}{runner}"

    @property
    def peer(self) -> str:
        """The transport-level name of this rank (Mooncake session id or NIXL agent name)."""
        peer = self.session_id if self.backend == "mooncake" else self.agent_name
        if peer is None:  # a registered transport's backend that names no agent
            return f"{self.engine_url}#{self.engine_rank}/{self.role}"
        return peer

    @property
    def key(self) -> EngineRankKey:
        """The engine rank this publication is of (a target and its draft share it)."""
        return EngineRankKey(self.engine_url, self.engine_rank)

    @property
    def runner(self) -> Runner:
        """(engine URL, engine rank, role): the model runner this publication is of."""
        return Runner(self.engine_url, self.engine_rank, self.role)

    @property
    def reached_through(self) -> tuple[str, str | None, str | None]:
        """(backend, Mooncake session, agent name): what a writer connects to for this rank
        (a target and its draft may share it)."""
        return (self.backend, self.session_id, self.agent_name)


def parse_publication(engine_url: str, engine_rank: int, body: dict[str, Any]) -> RankPublication:
    """Parse sglang's JSON answer for one rank; raise ``EngineError`` naming what is wrong.

    The answer is untrusted: every address, length and count in it is checked (an
    integer, in range, inside the 64-bit address space; parameters not partly
    overlapping; a delta scratch region that holds a header and overlaps no parameter)
    before anything is written with it."""
    info = body.get("remote_instance_transfer_engine_info") if isinstance(body, dict) else None
    if info is None:
        raise EngineError(
            f"engine {engine_url} rank {engine_rank}: answer has no "
            f"'remote_instance_transfer_engine_info'; start sglang with "
            f"--remote-instance-weight-loader-start-seed-via-transfer-engine (Mooncake) "
            f"or the p2pweights NIXL plugin"
        )
    answered = body.get("rank", engine_rank)
    if answered != engine_rank:
        raise EngineError(
            f"engine {engine_url} rank {engine_rank}: asked for rank {engine_rank}'s weights, "
            f"the engine answered for rank {answered!r:.40}; nothing was written. Is another "
            f"server answering at this URL?"
        )
    _refuse_withdrawn(engine_url, engine_rank, info)
    try:
        publication = _parse(engine_url, engine_rank, info)
        _check_regions(publication.regions)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"engine {engine_url} rank {engine_rank}: malformed weight publication: "
            f"{_reason(exc)}; nothing was written. The engine's sglang or p2pweights plugin "
            f"publishes something p2pweights cannot write safely"
        ) from exc
    return publication


def _refuse_withdrawn(engine_url: str, engine_rank: int, info: Any) -> None:
    """Raise ``EngineError`` with the engine's reason if it published an ``error``."""
    if not isinstance(info, dict) or info.get("error") is None:
        return
    backend = info.get("backend", "mooncake")
    raise EngineError(
        f"engine {engine_url} rank {engine_rank} could not publish its weights for "
        f"{str(backend)[:40]}: {str(info['error'])[:1000]}; nothing was written"
    )


def _reason(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"no {exc.args[0]!r} field" if exc.args else "a field is missing"
    return f"{type(exc).__name__}: {exc}"


def _parse(engine_url: str, engine_rank: int, info: Any) -> RankPublication:
    if isinstance(info, list) and len(info) == 2:
        session_id, table = info
        return RankPublication(
            engine_url,
            engine_rank,
            "mooncake",
            _regions(table),
            session_id=_text(session_id, "session_id"),
        )
    if not isinstance(info, dict):
        raise TypeError(f"expected a [session_id, table] pair or an object, got {info!r:.80}")
    backend = info.get("backend", "mooncake")
    table = info["weights_info_dict"]
    common: dict[str, Any] = {
        "live": _flag(info, "live"),
        "epoch": _integer(info.get("epoch", 0), "epoch"),
        "write_digests": _flag(info, "write_digests"),
        "digest_scheme": (
            None
            if info.get("digest_scheme") is None
            else _text(info["digest_scheme"], "digest_scheme")
        ),
    }
    if backend == "mooncake":
        return RankPublication(
            engine_url,
            engine_rank,
            "mooncake",
            _regions(table),
            session_id=_text(info["session_id"], "session_id"),
            **common,
        )
    if backend == "nixl":
        mem_type = info.get("mem_type")
        return RankPublication(
            engine_url,
            engine_rank,
            "nixl",
            _regions(table),
            agent_name=_text(info["agent_name"], "agent_name"),
            agent_metadata=base64.b64decode(_text(info["agent_metadata"], "agent_metadata")),
            mem_type=None if mem_type is None else _text(mem_type, "mem_type"),
            **common,
        )
    if backend == "cuda_ipc":
        segments = info["segments"]
        if not isinstance(segments, list):
            raise TypeError(f"segments must be a list, got {segments!r:.80}")
        return RankPublication(
            engine_url,
            engine_rank,
            "cuda_ipc",
            _regions(table),
            agent_name=_text(info["agent_name"], "agent_name"),
            host_id=_text(info["host_id"], "host_id"),
            segments=tuple(_segment(s) for s in segments),
            **common,
        )
    if isinstance(backend, str) and backend in registered_backends():
        agent = info.get("agent_name")
        return RankPublication(
            engine_url,
            engine_rank,
            backend,
            _regions(table),
            agent_name=None if agent is None else _text(agent, "agent_name"),
            extra=dict(info),
            **common,
        )
    raise ValueError(f"unknown published backend {backend!r:.40}")


IPC_HANDLE_BYTES = 64
"""Size of a ``cudaIpcMemHandle_t``."""

ADDRESS_SPACE_BYTES = 2**64
"""Every published address and end lies below this (64-bit pointers)."""

ELEMENT_SIZES = (1, 2, 4, 8, 16)
"""The bytes of one element of any torch dtype."""

_MAX_GPU_ID = 2**31


def _integer(value: Any, what: str, *, limit: int = ADDRESS_SPACE_BYTES) -> int:
    """``value`` as a JSON integer in ``[0, limit)``: a float, bool or string is refused
    (``int()`` would truncate or parse it)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {value!r:.40}")
    if not 0 <= value < limit:
        raise ValueError(f"{what} {value} is outside [0, {limit:#x})")
    return value


def _flag(info: dict[str, Any], key: str) -> bool:
    value = info.get(key, False)
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be true or false, got {value!r:.40}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {value!r:.40}")
    return value


def _segment(entry: Any) -> IpcSegment:
    if not isinstance(entry, dict):
        raise TypeError(f"a CUDA IPC segment must be an object, got {entry!r:.80}")
    handle = base64.b64decode(_text(entry["handle"], "a segment's handle"), validate=True)
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    address = _integer(entry["address"], "a segment's address")
    num_bytes = _integer(entry["num_bytes"], f"segment {address:#x}: num_bytes")
    offset = _integer(entry["offset"], f"segment {address:#x}: offset")
    for start, what in ((address, "address"), (offset, "offset")):
        if start + num_bytes > ADDRESS_SPACE_BYTES:
            raise ValueError(
                f"segment {address:#x}: {what} {start:#x} + {num_bytes} bytes runs past the "
                f"64-bit address space"
            )
    return IpcSegment(
        address=address,
        num_bytes=num_bytes,
        gpu_id=_integer(entry["gpu_id"], f"segment {address:#x}: gpu_id", limit=_MAX_GPU_ID),
        handle=handle,
        offset=offset,
    )


def _regions(table: Any) -> dict[str, WeightRegion]:
    if not isinstance(table, dict):
        raise TypeError(f"weights_info_dict must be an object, got {table!r:.80}")
    regions = {}
    for name, entry in table.items():
        regions[name] = _region(name, entry)
    return regions


def _region(name: str, entry: Any) -> WeightRegion:
    """One ``[address, numel, element_size(, gpu_id)]`` entry (more fields are ignored)."""
    if not isinstance(entry, list) or len(entry) < 3:
        raise TypeError(
            f"parameter {name!r}: expected [address, numel, element_size, (gpu_id)], "
            f"got {entry!r:.80}"
        )
    address = _integer(entry[0], f"parameter {name!r}: address")
    numel = _integer(entry[1], f"parameter {name!r}: numel")
    element_size = _integer(entry[2], f"parameter {name!r}: element_size")
    if element_size not in ELEMENT_SIZES:
        raise ValueError(f"parameter {name!r}: element_size {element_size} is no dtype's")
    num_bytes = numel * element_size
    if address + num_bytes > ADDRESS_SPACE_BYTES:
        raise ValueError(
            f"parameter {name!r}: {num_bytes} bytes at {address:#x} run past the 64-bit "
            f"address space"
        )
    gpu_id = None
    if len(entry) > 3:
        gpu_id = _integer(entry[3], f"parameter {name!r}: gpu_id", limit=_MAX_GPU_ID)
    return WeightRegion(address, num_bytes, gpu_id)


def _check_regions(regions: dict[str, WeightRegion]) -> None:
    """No two parameters partly overlap (one tensor published under two names, exactly
    the same bytes, is allowed); the delta scratch region holds a header and overlaps no
    parameter at all (the sender writes it, the engine reads it)."""
    scratch = regions.get(SCRATCH_NAME)
    if scratch is not None and scratch.num_bytes < HEADER_BYTES:
        raise ValueError(
            f"its delta scratch region {SCRATCH_NAME!r} has {scratch.num_bytes} bytes, too "
            f"few for the {HEADER_BYTES}-byte payload header; the engine must publish none "
            f"(P2PWEIGHTS_DELTA_SCRATCH=0) or at least {HEADER_BYTES} bytes"
        )
    ordered = sorted(
        (region.address, region.end, name) for name, region in regions.items() if region.num_bytes
    )
    reach: tuple[int, int, str] | None = None  # the region ending last so far
    for start, end, name in ordered:
        if reach is not None and start < reach[1]:
            same = (start, end) == reach[:2] and SCRATCH_NAME not in (name, reach[2])
            if not same:
                raise ValueError(
                    f"parameters {reach[2]!r} [{reach[0]:#x}, {reach[1]:#x}) and {name!r} "
                    f"[{start:#x}, {end:#x}) overlap; writing one would change the other"
                )
        if reach is None or end > reach[1]:
            reach = (start, end, name)


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
