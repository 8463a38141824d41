"""The contract with a real sglang 0.5.23 server, checked on every run from its recorded answers.

tests/fixtures/sglang-0.5.23-cpu/ holds what real servers on the CPU answered
(``/server_info``, ``/get_server_info``, ``/model_info``, ``/weights_checker`` and each
rank's ``/remote_instance_transfer_engine_info``), recorded by the real-server suite
(``P2PWEIGHTS_RECORD_ANSWERS=tests/fixtures/sglang-0.5.23-cpu bash scripts/real-sglang.sh
test``; docs/real-sglang.md): TP 1 and TP 2 publishing through the p2pweights NIXL plugin,
TP 1 whose parameters moved after every update (published afresh three times),
TP 1 publishing for Mooncake, and TP 1 under the CUDA IPC plugin (which refuses a CPU
server and publishes why). Here an ``EngineClient`` reads them through an
``httpx.MockTransport``, so connecting, reading checksums and the refusals run the real
code paths on the real answers, with no server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.client import EngineClient
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectOptions, Fleet
from p2pweights.errors import EngineError
from p2pweights.verify import checksums_by_rank

pytest.importorskip("sglang", reason="the replica runs sglang's model code")

ANSWERS = Path(__file__).parent.parent / "fixtures" / "sglang-0.5.23-cpu"


def answers(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((ANSWERS / f"{name}.json").read_text())
    return loaded


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """``replay[url] = answers(name)``: EngineClients of ``url`` get those answers."""
    servers: dict[str, dict[str, Any]] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        recorded = servers[f"{request.url.scheme}://{request.url.host}:{request.url.port}"]
        route = request.url.path
        if route == "/remote_instance_transfer_engine_info":
            rank = int(request.url.params["rank"])
            if request.url.params.get("role", "target") != "target":
                return httpx.Response(400, json={"error": {"message": "unknown role"}})
            return httpx.Response(200, json=recorded["publications"][rank])
        if route in recorded:
            return httpx.Response(200, json=recorded[route])
        return httpx.Response(404, json={"detail": "Not Found"})

    def client(url: str, **kwargs: Any) -> EngineClient:
        return EngineClient(url, transport=httpx.MockTransport(handle), **kwargs)

    monkeypatch.setattr(fleet_module, "EngineClient", client)
    return servers


def _connect(url: str, transport: str) -> Fleet:
    endpoint = EngineEndpoint(url, model_path=str(ANSWERS))  # config.json of the recorded model
    return Fleet.connect([endpoint], ConnectOptions(transport, timeout_s=5, control_timeout_s=5))


def test_the_real_server_info_redacts_watermark_fields_even_when_unset() -> None:
    info = answers("tp1")["/server_info"]
    assert info["version"] == "0.5.23" and info["device"] == "cpu"
    assert {info[k] for k in ("watermark_config", "watermark_key", "watermark_key_b")} == {
        "<redacted>"
    }
    assert answers("tp1")["/get_server_info"].keys() == info.keys()


@pytest.mark.parametrize("name", ["tp1", "tp2"])
def test_connect_takes_a_real_server_info_and_plugin_publications(
    name: str, replay: dict[str, dict[str, Any]]
) -> None:
    """Defect 1 of the first real run: the redacted fields were handed to sglang's
    ServerArgs, which raised WatermarkConfigError, so connect failed."""
    from p2pweights.replica.registry import replica_for

    url = f"http://{name}.test:30000"
    replay[url] = answers(name)
    fleet = _connect(url, "nixl")
    try:
        (engine,) = fleet.engines
        assert engine.num_ranks == answers(name)["/server_info"]["tp_size"]
        for rank, pub in enumerate(engine.publications):
            assert (pub.backend, pub.live, pub.epoch, pub.mem_type) == ("nixl", True, 0, "DRAM")
            assert len(pub.regions) == 19
            handle = replica_for(engine.server_info, rank, str(ANSWERS))
            handle.check_published(pub)  # every parameter's size as the engine published it
    finally:
        fleet.close_clients()


def test_checksums_of_a_real_tp2_server_are_read_per_rank() -> None:
    """Defect 2: 0.5.23 answers ``parallelism_info`` as a list (one entry per runner role);
    verify_engine indexed it as a dict and raised TypeError."""
    answer = answers("tp2")["/weights_checker"]
    assert all(isinstance(rank["parallelism_info"], list) for rank in answer["ranks"])
    ranks = checksums_by_rank("http://tp2.test:30000", answer)
    assert len(ranks) == 2 and all(len(r) == 19 for r in ranks)
    assert ranks[0] != ranks[1]  # each rank its own shard
    tp1 = checksums_by_rank("http://tp1.test:30000", answers("tp1")["/weights_checker"])
    assert len(tp1) == 1 and len(tp1[0]) == 19


def test_an_unreadable_checksum_answer_is_an_engine_error() -> None:
    with pytest.raises(EngineError, match=r"http://x:1.*cannot read"):
        checksums_by_rank("http://x:1", {"success": True, "ranks": [{"checksums": {}}]})
    rank0 = answers("tp2")["/weights_checker"]["ranks"][0]
    with pytest.raises(EngineError, match=r"answered TP ranks \[0, 0\]"):
        checksums_by_rank("http://x:1", {"success": True, "ranks": [rank0, rank0]})


def test_a_publication_republished_after_moved_storage_carries_its_epoch(
    replay: dict[str, dict[str, Any]],
) -> None:
    """Defect 3: parameters that get new storage at end_weight_update (AMX packing on CPU)
    left the start-up addresses pointing at freed memory; the plugin now publishes afresh."""
    recorded = answers("tp1-moving")
    info = recorded["publications"][0]["remote_instance_transfer_engine_info"]
    assert info["live"] is True and info["epoch"] == 3 and len(info["moved"]) == 19
    first = answers("tp1")["publications"][0]["remote_instance_transfer_engine_info"]
    assert first["epoch"] == 0 and "moved" not in first
    url = "http://moving.test:30000"
    replay[url] = recorded
    fleet = _connect(url, "nixl")
    try:
        (pub,) = fleet.engines[0].publications
        assert (pub.live, pub.epoch) == (True, 3)
        assert pub.agent_name == info["agent_name"]
    finally:
        fleet.close_clients()


def test_mooncake_into_a_real_cpu_server_is_refused_at_connect(
    replay: dict[str, dict[str, Any]],
) -> None:
    """Defect 4: sglang registers only CUDA allocator blocks with Mooncake, so a CPU server
    publishes addresses it never registered and refuses every write."""
    recorded = answers("tp1-mooncake")
    session_id, table = recorded["publications"][0]["remote_instance_transfer_engine_info"]
    assert isinstance(session_id, str) and len(table) == 19
    url = "http://mooncake.test:30000"
    replay[url] = recorded
    with pytest.raises(EngineError) as refused:
        _connect(url, "mooncake")
    message = str(refused.value)
    assert url in message and "NixlConfig" in message
    assert "SGLANG_PLUGINS=p2pweights_nixl" in message


def test_the_cuda_ipc_plugin_on_a_real_cpu_server_publishes_its_refusal(
    replay: dict[str, dict[str, Any]],
) -> None:
    """A real CPU server started with SGLANG_PLUGINS=p2pweights_cuda_ipc publishes why it
    cannot share its weights (they are not in GPU memory) instead of addresses; a
    CudaIpcConfig trainer is refused at connect with that reason, before any byte."""
    recorded = answers("tp1-cuda-ipc-cpu")
    info = recorded["publications"][0]["remote_instance_transfer_engine_info"]
    assert info["backend"] == "cuda_ipc" and "holds its weights on cpu" in info["error"]
    url = "http://cuda-ipc.test:30000"
    replay[url] = recorded
    with pytest.raises(EngineError) as refused:
        _connect(url, "cuda_ipc")
    message = str(refused.value)
    assert f"engine {url} rank 0 could not publish its weights for cuda_ipc" in message
    assert "holds its weights on cpu" in message
