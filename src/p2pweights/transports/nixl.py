"""Writes over NIXL, and the engine-side publisher in the form of sglang PR #35712.

The engine is passive: it registers its weight blocks with its own agent and
publishes that agent's metadata (taken after registration, so it lists them).
The trainer loads the metadata (``add_remote_agent``) and issues one-sided WRITEs.

Remote memory type. sglang's PR publishes VRAM regions with a ``gpu_id``; our
publisher can also publish host memory, with ``"mem_type": "DRAM"`` and
``gpu_id`` 0 (NIXL's device id for host memory). The transport does not trust a
flag for this: on connect it asks NIXL which segment of the loaded metadata
(VRAM or DRAM) holds the published regions (``check_remote_metadata``), trying
first the type the publication suggests.

Clean exit. The nixl-cu13 1.5.1 wheel bundles UCX whose EFA module links the
system ``libefa``, which drags in a second copy of ``libibverbs`` and ``libnl``;
at process exit (``_dl_fini``) the bundled ``libnl-route`` destructor then
segfaults (``rtnl_tc_unregister``), whatever Python released before. Releasing
the agent explicitly does not help. Unless the user set ``UCX_MODULES`` or the
host has EFA devices, we set ``UCX_MODULES=^efa`` before the first UCX agent of
the process, which keeps that module (and the second library copies) out.

Idle CPU. NIXL's Python front creates every agent with a progress thread that polls
UCX with a zero wait (``pthrDelay = 0``, not a constructor argument): one core per
agent spinning while nothing moves (measured: an idle TP-2 NIXL engine 0.5-2 cores).
Without target-side progress, writes over UCX's TCP transport never complete, so the
engine's agent keeps its thread but waits for UCX events, up to
``_PROGRESS_WAIT_US``: a write wakes it at once, an idle agent sleeps. The trainer's
agent has no progress thread: ``write()`` drives progress itself while it polls, and
a second thread on the same worker only contended with it (more CPU per write).

A write late at its deadline. Releasing an active transfer handle asks the backend to
cancel it, but a successful release confirms nothing: UCX's ``releaseReqH`` calls
``ucp_request_cancel`` on the requests not yet complete (which cannot recall an RMA
put already handed to the network; NIXL's own comment there says it "may not be
enough") and reports success whatever happened. So a transfer still in progress at
the deadline is not released: ``write`` raises ``UnsettledWrite``, whose ``settle``
polls ``check_xfer_state`` (driving progress) until NIXL reports it done or failed,
and only then releases the handle. Until then the staging memory it reads stays
registered, and ``close`` keeps the agent (``quarantine``).

Closing the publisher. Deregistering memory does not stop writes already on their way:
over UCX's TCP transport a put is a stream of bytes that the engine agent's progress
thread copies to the address it names, registered or not (RDMA hardware checks the
registration's key; TCP does not). A transfer a trainer gave up on can so keep landing
after the engine deregistered; if the engine then frees that memory while its agent
lives on, the progress thread copies into unmapped pages (a SIGSEGV in
``uct_tcp_iface_progress``, seen at an engine's exit: its weights were freed before its
publisher, whose agent still received). So ``close`` also ends the agent, joining its
progress thread and closing its UCX worker and endpoints: once it returns, nothing more
lands through it, and the memory may go; the trainer's transfer fails (its peer went),
which settles it. (A transport where the writer copies into this process by itself, as
UCX's CMA on one host, needs no agent here, and closing cannot stop it.)
"""

from __future__ import annotations

import base64
import contextlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from p2pweights.config import NixlConfig
from p2pweights.environment import keep_ucx_efa_module_out
from p2pweights.errors import ConfigError, TransferError, TransportError, UnsettledWrite, where
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

_MEM_TYPES = ("DRAM", "VRAM")


_PROGRESS_WAIT_US = 100_000
"""The longest an engine agent's progress thread sleeps waiting for UCX events (NIXL's
own listener thread uses the same); events wake it at once (see the module docstring)."""

_agent_creation = threading.Lock()


def _new_agent(name: str, backend: str, *, progress_thread: bool) -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as exc:
        raise TransportError(f"cannot import nixl ({exc}); pip install 'nixl>=1.5'") from exc
    if backend == "UCX":
        keep_ucx_efa_module_out()  # see the module docstring
    # Strict sync: write() may run in one thread per engine rank on the same agent.
    config = nixl_agent_config(
        backends=[backend],
        enable_prog_thread=progress_thread,
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    try:
        with _agent_creation, _waiting_progress_thread(nixl_agent):
            agent = nixl_agent(name, config)
    except Exception as exc:
        raise TransportError(f"cannot create NIXL agent {name!r} ({exc!r})") from exc
    if backend not in agent.backends:
        raise TransportError(
            f"NIXL backend {backend!r} is not available; plugins found: {agent.get_plugin_list()}"
        )
    return agent


@contextlib.contextmanager
def _waiting_progress_thread(nixl_agent: type) -> Iterator[None]:
    """While this thread creates an agent, its progress thread waits for UCX events
    instead of spinning: ``nixl_agent`` sets ``pthrDelay = 0`` on the config object it
    makes of its bindings' class, and for this thread only that assignment keeps
    ``_PROGRESS_WAIT_US`` (``p2pweights.thread_patch``: configs other threads make
    meanwhile keep what they are given). Where the bindings differ (another NIXL
    release), agents keep NIXL's default."""
    from p2pweights.thread_patch import UNSET, Current, thread_patch, unpatched

    bindings = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    base = unpatched(bindings, "nixlAgentConfig")
    if bindings is None or base is None or not hasattr(getattr(base, "pthrDelay", None), "__set__"):
        logger.debug("NIXL bindings without nixlAgentConfig.pthrDelay; progress thread unchanged")
        yield
        return

    def waiting_config(original: type, current: Current) -> type:
        delay: Any = original.pthrDelay  # type: ignore[attr-defined]

        def set_delay(config: Any, value: int) -> None:
            delay.__set__(config, value if current() is UNSET else _PROGRESS_WAIT_US)

        waiting = property(delay.__get__, set_delay)
        return type(original.__name__, (original,), {"pthrDelay": waiting})

    with thread_patch(bindings, "nixlAgentConfig", True, waiting_config):
        yield


def _mem_type(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of ``tensor`` (host memory is device 0)."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    if tensor.device.type == "cpu":
        return "DRAM", 0
    raise ConfigError(f"NIXL cannot register {tensor.device.type} memory")


class NixlTransport(Transport):
    """Trainer side: one NIXL agent per process writing into engines' published memory."""

    name = "nixl"

    @property
    def protocol(self) -> str:
        """The NIXL backend it writes through ("UCX", ...)."""
        return str(self._backend)

    def __init__(self, config: NixlConfig) -> None:
        self._backend = config.backend
        _ensure_cuda_context()
        self._agent = _new_agent(
            f"p2pweights_trainer_{uuid.uuid4().hex[:12]}", config.backend, progress_thread=False
        )
        self._lock = threading.Lock()
        self._registered: list[Any] = []  # nixlRegDList per buffer, for close()
        self._local: dict[str, list[tuple[int, int]]] = {}  # mem type -> buffers
        self._local_index: dict[str, RegionIndex] = {}
        self._local_device: dict[int, int] = {}  # buffer address -> device id
        self._descs: dict[int, Any] = {}  # buffer address -> its nixlRegDList
        self._remote: dict[str, _RemoteAgent] = {}  # agent name -> what we learnt
        # Transfers writes gave up on that had not ended: their memory stays registered.
        self._given_up = GivenUp("NIXL", "agent", "transfer")

    @property
    def agent_name(self) -> str:
        return str(self._agent.name)

    def register(self, buffer: torch.Tensor) -> None:
        address, num_bytes = source_region(buffer)
        mem_type, device = _mem_type(buffer)
        with self._lock:
            index = self._local_index.get(mem_type)
            if index is not None and index.covers(address, num_bytes):
                return
            try:
                descs = self._agent.register_memory([(address, num_bytes, device, "")], mem_type)
            except Exception as exc:
                raise TransportError(
                    f"NIXL register_memory of a {num_bytes}-byte {mem_type} buffer failed ({exc!r})"
                ) from exc
            self._registered.append(descs)
            self._descs[address] = descs
            self._local.setdefault(mem_type, []).append((address, num_bytes))
            self._local_index[mem_type] = RegionIndex(self._local[mem_type])
            self._local_device[address] = device

    def unregister(self, buffer: torch.Tensor) -> None:
        mem_type, _ = _mem_type(buffer)
        address = buffer.data_ptr()
        with self._lock:
            if self._given_up.keep_registered(buffer):
                return
            descs = self._descs.pop(address, None)
            if descs is None:
                return
            self._agent.deregister_memory(descs)
            self._registered.remove(descs)
            self._local[mem_type] = [r for r in self._local[mem_type] if r[0] != address]
            self._local_index[mem_type] = RegionIndex(self._local[mem_type])
            self._local_device.pop(address, None)

    def connect(self, target: RankPublication) -> None:
        require_backend(target, "nixl", usable=bool(target.agent_name and target.agent_metadata))
        with self._lock:
            if target.agent_name in self._remote:
                return
            try:
                loaded = self._agent.add_remote_agent(target.agent_metadata)
            except Exception as exc:
                raise TransportError(
                    f"{where(target.engine_url, target.engine_rank)}: cannot load NIXL agent "
                    f"{target.agent_name!r} ({exc!r}); re-fetch its publication"
                ) from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != target.agent_name:
                raise TransportError(
                    f"{where(target.engine_url, target.engine_rank)}: metadata is for agent "
                    f"{name!r}, the publication names {target.agent_name!r}"
                )
            self._remote[name] = self._learn_remote(target)

    def disconnect(self, target: RankPublication) -> None:
        with self._lock:
            if any(
                isinstance(e, _PendingTransfer) and e.peer == target.agent_name
                for e in self._given_up.unended()
            ):
                # NIXL deletes a handle whose remote agent went (getXferStatus answers
                # NOT_FOUND): it could then be neither polled nor released
                logger.warning(
                    "NIXL: agent %r stays loaded: a transfer given up on to it has not ended",
                    target.agent_name,
                )
                return
            if self._remote.pop(target.agent_name or "", None) is None:
                return
            try:
                self._agent.remove_remote_agent(target.agent_name)
            except Exception as exc:  # a dead peer's agent: forgotten here all the same
                logger.warning("NIXL: removing agent %r failed: %r", target.agent_name, exc)

    @property
    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._remote)

    def _learn_remote(self, target: RankPublication) -> _RemoteAgent:
        by_device: dict[int, list[tuple[int, int]]] = {}
        for region in target.regions.values():
            by_device.setdefault(region.gpu_id or 0, []).append((region.address, region.num_bytes))
        indexes = {device: RegionIndex(regions) for device, regions in by_device.items()}
        suggested = target.mem_type
        if suggested not in _MEM_TYPES:
            has_gpu = any(r.gpu_id is not None for r in target.regions.values())
            suggested = "VRAM" if has_gpu else "DRAM"
        for mem_type in (suggested, *(m for m in _MEM_TYPES if m != suggested)):
            descs = self._agent.get_xfer_descs(
                [(a, n, d) for d, index in indexes.items() for a, n in index.regions], mem_type
            )
            if descs is not None and self._agent.check_remote_metadata(target.agent_name, descs):
                return _RemoteAgent(mem_type, indexes)
        raise TransportError(
            f"{where(target.engine_url, target.engine_rank)}: NIXL agent {target.agent_name!r} "
            f"did not register the published regions (neither as VRAM nor DRAM); the "
            f"publication must be taken after registration"
        )

    def write(self, target: RankPublication, writes: Sequence[Write], timeout_s: float) -> None:
        if not writes:
            return
        self.connect(target)
        remote = self._remote[target.peer]
        local_mem, local_descs = self._local_descs(target, writes)
        remote_descs = []
        for i, w in enumerate(writes):
            device = w.dst_device if w.dst_device is not None else remote.device_of(w)
            if device is None:
                raise TransferError(
                    f"{where(target.engine_url, target.engine_rank)}: write #{i} "
                    f"(dst 0x{w.dst_address:x}, {w.num_bytes} bytes) leaves the published regions"
                )
            remote_descs.append((w.dst_address, w.num_bytes, device))
        deadline = time.monotonic() + timeout_s
        handle = None
        try:
            handle = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local_descs, local_mem),
                self._agent.get_xfer_descs(remote_descs, remote.mem_type),
                target.peer,
            )
            state = self._agent.transfer(handle)
        except Exception as exc:
            if handle is not None:  # made, but refused: NIXL would keep it until close
                self._release(handle)
            raise self._error(target, writes, f"NIXL refused the transfer ({exc!r})") from exc

        def ended() -> bool:
            nonlocal state
            state = self._agent.check_xfer_state(handle)
            return state != "PROC"

        try:
            poll_transfers(ended, deadline, first=state != "PROC")
        except Exception as exc:  # the bindings raise e.g. nixlRemoteDisconnectError
            # an error status: the backend ended the transfer, nothing more of it moves
            self._release(handle)
            raise self._error(target, writes, f"NIXL reported {exc!r}") from exc
        if state == "PROC":  # not released: see "A write late at its deadline" above
            transfer = _PendingTransfer(
                self._agent, handle, target.peer, [(w.src_address, w.num_bytes) for w in writes]
            )
            with self._lock:
                self._given_up.add(transfer)
            message = self._error(target, writes, f"not done after {timeout_s:g} s")
            raise UnsettledWrite(
                f"{message}; NIXL cannot confirm it cancelled, so it may still land and this "
                f"engine rank stays torn until NIXL reports it ended",
                transfer.settle,
            )
        self._release(handle)
        if state != "DONE":
            raise self._error(target, writes, f"NIXL reported {state}")

    def _local_descs(
        self, target: RankPublication, writes: Sequence[Write]
    ) -> tuple[str, list[tuple[int, int, int]]]:
        descs = []
        mem_types = set()
        for i, w in enumerate(writes):
            for mem_type, index in self._local_index.items():
                region = index.find(w.src_address, w.num_bytes)
                if region is not None:
                    mem_types.add(mem_type)
                    descs.append((w.src_address, w.num_bytes, self._local_device[region[0]]))
                    break
            else:
                raise TransferError(
                    f"{where(target.engine_url, target.engine_rank)}: write #{i} "
                    f"(src 0x{w.src_address:x}, {w.num_bytes} bytes) is not in a registered "
                    f"buffer; register the staging buffer first"
                )
        if len(mem_types) > 1:
            raise TransferError("one write() must not mix host and device source buffers")
        return mem_types.pop(), descs

    def _release(self, handle: Any) -> None:
        # Only handles whose transfer ended (or never started) come here, so NIXL has
        # nothing to cancel; should it refuse anyway, it keeps the handle until close.
        _release(self._agent, handle)

    def _error(
        self, target: RankPublication, writes: Sequence[Write], reason: str
    ) -> TransferError:
        total = sum(w.num_bytes for w in writes)
        return TransferError(
            f"{where(target.engine_url, target.engine_rank)} (NIXL agent {target.agent_name}): "
            f"a batch of {len(writes)} writes ({total} bytes, first dst "
            f"0x{writes[0].dst_address:x}) failed: {reason}; check that the engine is alive and "
            f"re-fetch its publication if it restarted"
        )

    def close(self) -> None:
        with self._lock:
            # the agent may still move the bytes of transfers given up on: then neither
            # it, its connections, nor the memory registered with it may go
            if self._given_up.keep_at_close(self._agent, lambda: self.agent_name, self._registered):
                self._remote.clear()
                self._registered = []
                return
            for name in self._remote:
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as exc:
                    logger.debug("remove_remote_agent(%s) failed: %r", name, exc)
            self._remote.clear()
            for descs in self._registered:
                self._agent.deregister_memory(descs)
            self._registered.clear()
            self._local.clear()
            self._local_index.clear()
            self._local_device.clear()
            self._descs.clear()


def _release(agent: Any, handle: Any) -> None:
    try:
        agent.release_xfer_handle(handle)
    except Exception as exc:
        logger.warning("could not release a NIXL transfer handle (%r); NIXL keeps it", exc)


class _PendingTransfer(InFlight):
    """A NIXL transfer a write gave up on, polled until NIXL reports it done or failed,
    then released (its handle object is kept: dropping it would release it, cancelling)."""

    def __init__(self, agent: Any, handle: Any, peer: str, sources: list[tuple[int, int]]):
        super().__init__(sources)
        self._agent = agent
        self._handle = handle
        self.peer = peer

    def _poll(self) -> bool:
        try:
            return self._agent.check_xfer_state(self._handle) != "PROC"
        except Exception as exc:  # an error status: the backend ended it
            logger.debug("NIXL: a late transfer ended with %r", exc)
            return True

    def _release(self) -> None:
        _release(self._agent, self._handle)


class _RemoteAgent:
    """What a loaded remote agent exposes: its memory type and regions per device."""

    def __init__(self, mem_type: str, indexes: dict[int, RegionIndex]) -> None:
        self.mem_type = mem_type
        self._indexes = indexes

    def device_of(self, write: Write) -> int | None:
        for device, index in self._indexes.items():
            if index.covers(write.dst_address, write.num_bytes):
                return device
        return None


def _ensure_cuda_context() -> None:
    """UCX picks its transports when the agent starts: without a CUDA context then, it
    leaves out its GPU transports (cuda_ipc, cuda_copy), and GPU-to-GPU writes crawl
    over the host. Trainers usually have one already; make sure on CUDA hosts."""
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.empty(1, device=torch.device("cuda", torch.cuda.current_device()))


class NixlPublisher(Publisher):
    """Engine side: its own agent ``nixl_weight_tp{rank}_<uuid>``, like sglang PR #35712."""

    def __init__(self, backend: str = "UCX", engine_rank: int = 0) -> None:
        _ensure_cuda_context()
        self._agent: Any = _new_agent(
            f"nixl_weight_tp{engine_rank}_{uuid.uuid4().hex}", backend, progress_thread=True
        )
        self._name = str(self._agent.name)
        self._registered: list[Any] = []
        self._index = RegionIndex([])
        self._mem_type = "DRAM"
        self._device = 0

    @property
    def agent_name(self) -> str:
        return self._name

    def _open_agent(self) -> Any:
        if self._agent is None:
            raise TransportError(f"NIXL agent {self._name} was closed; publish with a new one")
        return self._agent

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        agent = self._open_agent()
        self._mem_type, self._device = _mem_type(next(iter(tensors.values())))
        regions = [r for r in merged_regions(tensors.values()) if not self._index.covers(*r)]
        if not regions:
            return
        try:
            descs = agent.register_memory(
                [(a, n, self._device, "") for a, n in regions], self._mem_type
            )
        except Exception as exc:
            raise TransportError(
                f"NIXL register_memory of {len(regions)} regions failed ({exc!r})"
            ) from exc
        self._registered.append(descs)
        self._index = RegionIndex([*self._index.regions, *regions])

    def publication(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """sglang PR #35712's form plus ``"mem_type"``; ``gpu_id`` is 0 for host memory."""
        metadata = self._open_agent().get_agent_metadata()
        table = weights_info(tensors, self._index, self._device)
        return {
            "backend": "nixl",
            "agent_name": self.agent_name,
            "agent_metadata": base64.b64encode(metadata).decode("ascii"),
            "weights_info_dict": table,
            "mem_type": self._mem_type,
        }

    def close(self) -> None:
        """Deregister, then end the agent: once this returns, no write arrives through it
        (see "Closing the publisher" in the module docstring)."""
        agent, self._agent = self._agent, None
        if agent is None:
            return
        try:
            for descs in self._registered:
                agent.deregister_memory(descs)
        finally:
            self._registered.clear()
            self._index = RegionIndex([])
            # The publisher is the agent's only owner: dropping it destroys the NIXL agent
            # here, which joins its progress thread and closes its UCX worker and endpoints.
            del agent
