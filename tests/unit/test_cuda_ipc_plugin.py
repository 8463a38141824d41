"""The sglang plugin's CUDA IPC publication, on a host without a GPU: a fake CUDA runtime
and a fake model whose parameters claim to live on a GPU, as the transport's own tests
fake what needs CUDA.

The engine side publishes through the plugin's hooks to a real bootstrap server; the
trainer side reads it through ``EngineClient`` and ``connect_engine`` (an sglang HTTP
server's route replayed by an ``httpx.MockTransport`` that asks the bootstrap server)
and opens it with a ``CudaIpcTransport`` over a fake runtime. tests/real_sglang runs the
same against a real sglang server on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

import p2pweights.sglang_plugin as plugin
from p2pweights import CudaIpcConfig
from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.client import EngineClient
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectedEngine, ConnectOptions, connect_engine
from p2pweights.errors import EngineError, TransportError
from p2pweights.local_engine.process import free_port
from p2pweights.sglang_plugin import ipc_publish
from p2pweights.sglang_plugin.bootstrap import NixlAwareBootstrapServer
from p2pweights.sglang_plugin.ipc_publish import IpcLivePublication, publish_ipc
from p2pweights.sglang_plugin.publish import put_publication
from p2pweights.transports import cuda_ipc
from p2pweights.transports.cuda_ipc import CudaIpcTransport, host_id

URL = "http://127.0.0.1:30000"
SGLANG = importlib.metadata.version("sglang")
GPU = torch.device("cuda", 0)


@dataclass
class _Storage:
    address: int
    size: int

    def data_ptr(self) -> int:
        return self.address

    def nbytes(self) -> int:
        return self.size


class FakeGpuTensor:
    """What the publisher and the plugin read of a parameter on a GPU: its own storage,
    at a made-up device address."""

    def __init__(self, address: int, numel: int, element_size: int = 2, device=GPU) -> None:
        self.address, self._numel, self._element_size = address, numel, element_size
        self.device = device

    @property
    def data(self) -> FakeGpuTensor:
        return self

    @property
    def nbytes(self) -> int:
        return self._numel * self._element_size

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._element_size

    def untyped_storage(self) -> _Storage:
        return _Storage(self.address, self.nbytes)


class FakeModel:
    def __init__(self, params: dict[str, FakeGpuTensor]) -> None:
        self.params = params

    def named_parameters(self) -> Iterator[tuple[str, FakeGpuTensor]]:
        return iter(self.params.items())


@dataclass
class FakeRuntime:
    """The CUDA calls both sides make. ``allocations``: base -> size of the engine's
    device allocations (torch's allocator segments); handles name their base."""

    allocations: dict[int, int]
    fail_handles: bool = False
    asked: list[int] = field(default_factory=list)
    opened: list[bytes] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)

    def on_device(self, device: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def allocation_range(self, address: int) -> tuple[int, int]:
        for base, size in self.allocations.items():
            if base <= address < base + size:
                return base, size
        if address >= 0x7000_0000_0000:  # a mapping the trainer opened: the whole allocation
            base = self._engine_base(address)
            return address, self.allocations[base]
        raise TransportError(f"cuMemGetAddressRange({address:#x}) failed: CUDA driver 1")

    def ipc_handle(self, base: int) -> bytes:
        if self.fail_handles:
            raise TransportError("cudaIpcGetMemHandle failed: CUDA error 1 (invalid argument)")
        assert base in self.allocations, "a handle must be taken of an allocation's base"
        self.asked.append(base)
        return handle_of(base)

    def open_ipc_handle(self, handle: bytes, device: int) -> int:
        self.opened.append(handle)
        return 0x7000_0000_0000 + int.from_bytes(handle[:8], "little")

    def _engine_base(self, pointer: int) -> int:
        return pointer - 0x7000_0000_0000

    def close_ipc_handle(self, pointer: int) -> None:
        self.closed.append(pointer)


def handle_of(base: int) -> bytes:
    return base.to_bytes(8, "little") + b"\x01" * 56


BASE_A, BASE_B, BASE_C = 0x10_0000_0000, 0x20_0000_0000, 0x30_0000_0000


def _model() -> FakeModel:
    """Three parameters in two allocations: two views of one 2 MiB segment, one of its own."""
    return FakeModel(
        {
            "model.embed_tokens.weight": FakeGpuTensor(BASE_A + 0x200, 1024),
            "model.norm.weight": FakeGpuTensor(BASE_A + 0xA00, 64),  # right after it
            "lm_head.weight": FakeGpuTensor(BASE_B, 4096),
        }
    )


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime({BASE_A: 2 << 20, BASE_B: 8192, BASE_C: 16384})
    monkeypatch.setattr(cuda_ipc, "cuda_runtime", lambda: fake)
    monkeypatch.delenv("P2PWEIGHTS_DELTA_SCRATCH", raising=False)
    monkeypatch.delenv("P2PWEIGHTS_WRITE_DIGESTS", raising=False)
    return fake


@pytest.fixture
def bootstrap() -> Iterator[NixlAwareBootstrapServer]:
    started = NixlAwareBootstrapServer("127.0.0.1", free_port())
    yield started
    started.close()


def _published(server: NixlAwareBootstrapServer, rank: int = 0) -> dict[str, Any]:
    body = httpx.get(f"{server.url}/get_transfer_engine_info", params={"rank": rank}).json()
    info: dict[str, Any] = body["remote_instance_transfer_engine_info"]
    return info


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, bootstrap: NixlAwareBootstrapServer) -> None:
    """EngineClients of ``URL`` reach an sglang HTTP server whose publication route asks
    ``bootstrap``, as sglang's ``/remote_instance_transfer_engine_info`` does."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"tp_size": 1, "version": SGLANG, "device": "cuda"})
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": "default"})
        rank = request.url.params["rank"]
        asked = httpx.get(f"{bootstrap.url}/get_transfer_engine_info", params={"rank": rank})
        return httpx.Response(asked.status_code, content=asked.content)

    def client(url: str, **kwargs: Any) -> EngineClient:
        return EngineClient(url, transport=httpx.MockTransport(handler), **kwargs)

    monkeypatch.setattr(fleet_module, "EngineClient", client)


def _connect(kind: str) -> ConnectedEngine:
    return connect_engine(0, EngineEndpoint(URL), ConnectOptions(kind, 5.0, 5.0))


def test_a_rank_publishes_the_ipc_handle_of_each_allocation_holding_its_weights(
    runtime: FakeRuntime, bootstrap: NixlAwareBootstrapServer
) -> None:
    model = _model()
    published = publish_ipc(0, bootstrap.url, model)  # type: ignore[arg-type]
    assert published is not None and published.epoch == 0
    info = _published(bootstrap)
    assert info["backend"] == "cuda_ipc" and info["host_id"] == host_id()
    assert (info["live"], info["epoch"]) == (True, 0)
    assert info["agent_name"].startswith("cuda_ipc_weight_tp0_")
    assert sorted(runtime.asked) == [BASE_A, BASE_B]  # each base once, never a view's address
    # the two views merge into one block at the first one's storage, offset into segment A
    assert sorted((s["address"], s["num_bytes"], s["offset"]) for s in info["segments"]) == [
        (BASE_A + 0x200, 0x800 + 0x80, 0x200),
        (BASE_B, 8192, 0),
    ]
    assert info["weights_info_dict"] == {
        name: [p.address, p.numel(), 2, 0] for name, p in model.params.items()
    }


def test_the_trainer_reads_it_through_connect_and_opens_every_allocation_once(
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    engine: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish_ipc(0, bootstrap.url, _model())  # type: ignore[arg-type]
    connected = _connect("cuda_ipc")
    try:
        (pub,) = connected.publications
        assert (pub.backend, pub.live, pub.epoch, len(pub.regions)) == ("cuda_ipc", True, 0, 3)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        transport = CudaIpcTransport(CudaIpcConfig(device=0))
        transport.connect(pub)
        assert sorted(runtime.opened) == sorted([handle_of(BASE_A), handle_of(BASE_B)])
        assert transport.peers == {pub.peer}
        transport.close()
        assert len(runtime.closed) == 2
    finally:
        connected.client.close()


def test_moved_storage_is_published_afresh_and_the_old_handles_are_gone(
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    engine: None,
) -> None:
    model = _model()
    published = publish_ipc(0, bootstrap.url, model)  # type: ignore[arg-type]
    assert published is not None
    first = _published(bootstrap)
    assert published.refresh(model, "begin_weight_update") == []  # nothing moved
    assert _published(bootstrap) == first

    # postprocess gave lm_head new storage (in allocation C), as sglang's repacking does
    model.params["lm_head.weight"] = FakeGpuTensor(BASE_C + 0x100, 4096)
    assert published.refresh(model, "end_weight_update") == ["lm_head.weight"]
    info = _published(bootstrap)
    assert (info["live"], info["epoch"], info["moved"]) == (True, 1, ["lm_head.weight"])
    assert info["agent_name"] != first["agent_name"]  # a new peer: writers reconnect
    handles = {s["handle"] for s in info["segments"]}
    old_b = {s["handle"] for s in first["segments"] if s["address"] == BASE_B}
    assert not handles & old_b  # the freed allocation's handle is no longer published
    assert info["weights_info_dict"]["lm_head.weight"][0] == BASE_C + 0x100

    connected = _connect("cuda_ipc")  # the trainer reads the new epoch
    try:
        (pub,) = connected.publications
        assert (pub.epoch, pub.regions["lm_head.weight"].address) == (1, BASE_C + 0x100)
    finally:
        connected.client.close()


def test_a_rank_that_cannot_publish_afresh_withdraws_its_handles(
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    engine: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handle cannot be revoked, so stale ones must stop being served: the rank
    publishes why instead, and a trainer re-reading it is refused before any write."""
    model = _model()
    published = publish_ipc(0, bootstrap.url, model)  # type: ignore[arg-type]
    assert published is not None
    model.params["lm_head.weight"] = FakeGpuTensor(BASE_C, 4096)
    runtime.fail_handles = True
    assert published.refresh(model, "end_weight_update") == ["lm_head.weight"]  # not raised
    info = _published(bootstrap)
    assert info["backend"] == "cuda_ipc" and info["epoch"] == 1 and "segments" not in info
    assert "could not be published afresh" in info["error"]
    assert "p2pweights_cuda_ipc: tp rank 0 could not publish afresh" in caplog.text
    with pytest.raises(EngineError) as refused:
        _connect("cuda_ipc")
    message = str(refused.value)
    assert f"engine {URL} rank 0 could not publish its weights for cuda_ipc" in message
    assert "restart the engine" in message and "nothing was written" in message


def test_a_withdrawal_that_could_not_be_put_is_put_at_the_next_hook(
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    engine: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Publishing afresh failed and so did the PUT of the withdrawal (the bootstrap server
    did not answer inside the hook): the start-up handles, whose memory is freed, are still
    served. The next hook (begin_weight_update's AFTER, before the trainer re-reads the
    publication and writes) puts the withdrawal again, so no writer is sent there."""
    model = _model()
    published = publish_ipc(0, bootstrap.url, model)  # type: ignore[arg-type]
    assert published is not None
    first = _published(bootstrap)
    model.params["lm_head.weight"] = FakeGpuTensor(BASE_C, 4096)
    runtime.fail_handles = True
    real_put = ipc_publish.put_publication

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise httpx.ConnectError("the bootstrap server did not answer")

    monkeypatch.setattr(ipc_publish, "put_publication", unreachable)
    assert published.refresh(model, "end_weight_update") == ["lm_head.weight"]  # not raised
    assert _published(bootstrap) == first  # stale: what the bootstrap server still serves

    monkeypatch.setattr(ipc_publish, "put_publication", real_put)
    published.refresh(model, "begin_weight_update")  # the next hook, still unable to publish
    info = _published(bootstrap)
    assert "segments" not in info and "could not be published afresh" in info["error"]
    with pytest.raises(EngineError, match="could not publish its weights for cuda_ipc"):
        _connect("cuda_ipc")

    published.refresh(model, "end_weight_update")  # withdrawn once: not put again
    assert _published(bootstrap) == info


def test_a_cpu_server_is_refused_logged_and_recorded_never_raised(
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    engine: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cpu = torch.device("cpu")
    model = FakeModel({"w": FakeGpuTensor(0x1000, 64, device=cpu)})
    assert publish_ipc(0, bootstrap.url, model) is None  # type: ignore[arg-type]
    assert runtime.asked == []
    assert "p2pweights_cuda_ipc: tp rank 0 does not publish its weights" in caplog.text
    assert "shares GPU memory only" in caplog.text and "on cpu" in caplog.text
    with pytest.raises(EngineError) as refused:
        _connect("cuda_ipc")
    message = str(refused.value)
    assert f"engine {URL} rank 0 could not publish its weights for cuda_ipc" in message
    assert "--device cuda" in message and "NixlConfig" in message


def test_weights_under_sglangs_memory_saver_are_refused_before_any_handle(
    hooks: list[str],
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its VMM allocations cannot be shared by IPC handle, and a resume gives them new
    physical memory at the same addresses, which no address check would see."""
    from p2pweights.replica.sglang import facade

    plugin.register_cuda_ipc()
    monkeypatch.setattr(facade, "bootstrap_url", lambda: bootstrap.url)
    runner = SimpleNamespace(
        model=_model(),
        is_draft_worker=False,
        remote_instance_weight_transporter=SimpleNamespace(tp_rank=0),
        memory_saver_adapter=SimpleNamespace(enabled=True),
    )
    plugin.publish_after_initialize(None, runner)  # not raised
    assert id(runner) not in plugin._published and runtime.asked == []
    error = _published(bootstrap)["error"]
    assert "--enable-memory-saver" in error and "resume_memory_occupation" in error


def test_a_handle_the_driver_refuses_is_recorded_with_the_reason(
    runtime: FakeRuntime, bootstrap: NixlAwareBootstrapServer
) -> None:
    runtime.fail_handles = True
    assert publish_ipc(0, bootstrap.url, _model()) is None  # type: ignore[arg-type]
    error = _published(bootstrap)["error"]
    assert "tp rank 0: cannot share the weights by CUDA IPC handle" in error
    assert "cudaIpcGetMemHandle failed" in error and "--enable-memory-saver" in error


@pytest.mark.parametrize(
    ("published", "session", "fix", "flag"),
    [
        ("cuda_ipc", "nixl", "CudaIpcConfig", "SGLANG_PLUGINS=p2pweights_nixl"),
        ("cuda_ipc", "mooncake", "CudaIpcConfig", "--remote-instance-weight-loader"),
        ("nixl", "cuda_ipc", "NixlConfig", "SGLANG_PLUGINS=p2pweights_cuda_ipc"),
    ],
)
def test_a_transport_mismatch_names_both_sides_and_the_fix(
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    engine: None,
    published: str,
    session: str,
    fix: str,
    flag: str,
) -> None:
    if published == "cuda_ipc":
        publish_ipc(0, bootstrap.url, _model())  # type: ignore[arg-type]
    else:
        nixl = {"backend": "nixl", "agent_name": "a", "agent_metadata": "bWV0YQ=="}
        body = {"tp_rank": 0, "transfer_engine_info": nixl | {"weights_info_dict": {}}}
        httpx.put(f"{bootstrap.url}/register_transfer_engine_info", json=body)
    with pytest.raises(EngineError) as refused:
        _connect(session)
    message = str(refused.value)
    assert f"engine {URL} rank 0 published its weights for {published}" in message
    assert f"writes over {session}" in message
    assert f"SyncConfig(transport={fix}(...))" in message and flag in message


def test_the_bootstrap_server_refuses_an_ipc_publication_without_its_segments(
    bootstrap: NixlAwareBootstrapServer,
) -> None:
    info = {"backend": "cuda_ipc", "agent_name": "a", "host_id": "h", "weights_info_dict": {}}
    body = {"tp_rank": 0, "transfer_engine_info": info}
    response = httpx.put(f"{bootstrap.url}/register_transfer_engine_info", json=body)
    assert response.status_code == 400 and "segments" in response.text
    with pytest.raises(EngineError, match=r"refused the CUDA IPC publication.*p2pweights_cuda_ipc"):
        put_publication(bootstrap.url, 0, info, timeout_s=5)


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hook targets the plugin registers (with sglang's registry left alone)."""
    from p2pweights.replica.sglang import facade

    registered: list[str] = []
    monkeypatch.setattr(facade, "register_hook", lambda target, *_: registered.append(target))
    monkeypatch.setattr(plugin, "_asked", set())
    return registered


@pytest.mark.parametrize(
    ("entry_points", "backend"),
    [
        (["p2pweights_nixl"], "nixl"),
        (["p2pweights_cuda_ipc"], "cuda_ipc"),
        (["p2pweights_cuda_ipc", "p2pweights_nixl"], "nixl"),  # SGLANG_PLUGINS unset
        (["p2pweights_nixl", "p2pweights_cuda_ipc"], "nixl"),
    ],
)
def test_the_entry_point_picks_the_backend_and_hooks_register_once(
    hooks: list[str], entry_points: list[str], backend: str
) -> None:
    calls = {"p2pweights_nixl": plugin.register, "p2pweights_cuda_ipc": plugin.register_cuda_ipc}
    for name in entry_points:
        calls[name]()
    assert plugin.publishing_backend() == backend
    assert len(hooks) == len(set(hooks)) + 1  # END_TARGET twice (BEFORE and AFTER), once each


def test_the_hooks_publish_and_republish_for_cuda_ipc(
    hooks: list[str],
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from p2pweights.replica.sglang import facade

    plugin.register_cuda_ipc()
    monkeypatch.setattr(facade, "bootstrap_url", lambda: bootstrap.url)
    model = _model()
    runner = SimpleNamespace(
        model=model, is_draft_worker=False, remote_instance_weight_transporter=None
    )
    monkeypatch.setattr(facade, "parallel", lambda: SimpleNamespace(tp_rank=0))
    updater = SimpleNamespace(get_model_runner=lambda: runner)
    try:
        plugin.publish_after_initialize(None, runner)
        published = plugin._published[id(runner)]
        assert isinstance(published, IpcLivePublication)
        assert _published(bootstrap)["epoch"] == 0
        model.params["model.norm.weight"] = FakeGpuTensor(BASE_C, 64)
        plugin.republish_after_end(None, updater)
        info = _published(bootstrap)
        assert (info["epoch"], info["moved"]) == (1, ["model.norm.weight"])
        plugin.republish_after_begin(None, updater)  # nothing moved since
        assert _published(bootstrap)["epoch"] == 1
    finally:
        plugin._published.pop(id(runner), None)
        plugin._sides.pop(id(runner), None)


def test_a_trainer_follows_a_republication_and_closes_the_old_mappings(
    runtime: FakeRuntime,
    bootstrap: NixlAwareBootstrapServer,
    engine: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a session does when it re-reads a live publication that moved: the executor
    drops the old peer (its mappings closed, so nothing can be written through them) and
    opens the new publication's allocations."""
    from p2pweights.transfer.executor import TransferExecutor

    model = _model()
    published = publish_ipc(0, bootstrap.url, model)  # type: ignore[arg-type]
    assert published is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    transport = CudaIpcTransport(CudaIpcConfig(device=0))
    executor = TransferExecutor(transport, torch.device("cpu"), timeout_s=5.0)
    connected = _connect("cuda_ipc")
    try:
        (first,) = connected.publications
        executor.connect([first])
        executor.connect([connected.client.publication(0)])  # re-read, unchanged: kept
        assert sorted(runtime.opened) == sorted([handle_of(BASE_A), handle_of(BASE_B)])
        assert runtime.closed == []

        model.params["lm_head.weight"] = FakeGpuTensor(BASE_C, 4096)
        published.refresh(model, "end_weight_update")
        moved = connected.client.publication(0)
        assert (moved.epoch, moved.peer != first.peer) == (1, True)
        executor.connect([moved])
        mapped = {0x7000_0000_0000 + base for base in (BASE_A, BASE_B)}
        assert set(runtime.closed) == mapped  # every mapping of the old publication
        assert runtime.opened[2:] == [handle_of(BASE_A), handle_of(BASE_C)]
        assert transport.peers == {moved.peer}
    finally:
        executor.disconnect()
        transport.close()
        connected.client.close()
