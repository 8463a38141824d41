"""The contract with a real sglang 0.5.23 server, checked on every run from its recorded answers.

tests/fixtures/sglang-0.5.23-cpu/ holds what real servers on the CPU answered
(``/server_info``, ``/get_server_info``, ``/model_info``, ``/weights_checker`` and each
rank's ``/remote_instance_transfer_engine_info``), recorded by the real-server suite
(``P2PWEIGHTS_RECORD_ANSWERS=tests/fixtures/sglang-0.5.23-cpu bash scripts/real-sglang.sh
test``; docs/real-sglang.md): TP 1 and TP 2 publishing through the p2pweights NIXL plugin,
TP 1 whose parameters moved after every update (published afresh three times),
TP 1 publishing for Mooncake, and TP 1 under the CUDA IPC plugin (which refuses a CPU
server and publishes why).

tests/fixtures/sglang-0.5.23-gpu/ holds the same answers (less ``/get_server_info``, the
same as ``/server_info``) of real servers on a GPU (an H100, TP 1, Triton attention,
decode CUDA graphs captured), recorded on 2026-12-07 by the GPU runbook's
``bash scripts/gpu_sglang/device.sh stage2 "qwen3-mooncake or qwen3-nixl or (cuda_ipc_into
and not moving)"`` (docs/real-sglang.md, "On the GPU": it sets ``P2PWEIGHTS_RECORD_ANSWERS``
for tests/real_sglang/test_real_server_gpu.py and test_real_server.py, and packs the
answers/ folder into its logs.tgz), each after that suite's updates passed bit-exact:

* ``gpu-qwen3-mooncake-device``: sglang's own Mooncake publication
  (``--remote-instance-weight-loader-start-seed-via-transfer-engine``,
  ``MOONCAKE_PROTOCOL=tcp``, no plugin) after three updates (seeds 11, 12, 13; seed 13's
  weights are live), verified by ``/weights_checker`` (sglang's GPU hash). The
  ``mooncake-host`` case ran the same server (only the trainer staged elsewhere), whose
  answers differ in ports, random seed, timings and published addresses: not kept;
* ``gpu-qwen3-nixl``: the p2pweights NIXL plugin publishing VRAM, after the same three
  updates, verified by write digests;
* ``tp1-cuda-ipc``: the p2pweights CUDA IPC plugin (``SGLANG_PLUGINS=p2pweights_cuda_ipc``)
  publishing by IPC handle to the colocated trainer, after four updates (seeds 11, 12,
  13, then 11 again, staged), verified by write digests.

Here an ``EngineClient`` reads them through an ``httpx.MockTransport``, so connecting,
reading checksums, the refusals and the choice of the checker's hash run the real code
paths on the real answers, with no server and no GPU. The sender's hashes of the bytes it
stages for the last update are compared with the servers' ``/weights_checker`` answers:
sha256 (a CPU engine's) with the CPU server's on every run, and, in two slow cases
(``-m slow``), sglang's own GPU hash kernels, run by Triton's interpreter, with the GPU
servers'.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.client import EngineClient
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectOptions, Fleet
from p2pweights.errors import ConfigError, EngineError
from p2pweights.verify import checksums_by_rank
from p2pweights.wire.digest import SCHEME
from p2pweights.wire.landed import flag_names

pytest.importorskip("sglang", reason="the replica runs sglang's model code")

ANSWERS = Path(__file__).parent.parent / "fixtures" / "sglang-0.5.23-cpu"
GPU_ANSWERS = ANSWERS.with_name("sglang-0.5.23-gpu")


def answers(name: str, folder: Path = ANSWERS) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((folder / f"{name}.json").read_text())
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


def _connect(url: str, transport: str, folder: Path = ANSWERS) -> Fleet:
    endpoint = EngineEndpoint(url, model_path=str(folder))  # config.json of the recorded model
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


GPU_SERVERS = ("gpu-qwen3-mooncake-device", "gpu-qwen3-nixl", "tp1-cuda-ipc")
LAST_SEED = {"gpu-qwen3-mooncake-device": 13, "gpu-qwen3-nixl": 13, "tp1-cuda-ipc": 11}
"""The seed whose synthetic weights each GPU server held when it answered (the GPU suite's
SEEDS in order; the CUDA IPC case wrote seed 11 once more, staged, as its fourth)."""


@pytest.mark.parametrize("name", GPU_SERVERS)
def test_the_gpu_servers_ran_sglang_0_5_23_on_cuda(name: str) -> None:
    info = answers(name, GPU_ANSWERS)["/server_info"]
    assert (info["version"], info["device"], info["tp_size"]) == ("0.5.23", "cuda", 1)
    assert info["attention_backend"] == "triton" and info["disable_cuda_graph"] is False
    assert (GPU_ANSWERS / "config.json").read_text() == (ANSWERS / "config.json").read_text()


def test_connect_takes_sglangs_own_mooncake_publication_from_a_gpu_server(
    replay: dict[str, dict[str, Any]],
) -> None:
    """The publication a CPU server is refused for (defect 4) is taken from a GPU server:
    sglang registered its CUDA weights with Mooncake. Each region is read at the address
    and length sglang published, the length of the replica's parameter."""
    from p2pweights.replica.registry import replica_for

    recorded = answers("gpu-qwen3-mooncake-device", GPU_ANSWERS)
    assert recorded["/server_info"]["remote_instance_weight_loader_start_seed_via_transfer_engine"]
    session_id, table = recorded["publications"][0]["remote_instance_transfer_engine_info"]
    url = "http://gpu-mooncake.test:30000"
    replay[url] = recorded
    fleet = _connect(url, "mooncake", GPU_ANSWERS)
    try:
        (engine,) = fleet.engines
        (pub,) = engine.publications
        assert (pub.backend, pub.session_id, pub.live, pub.epoch) == (
            "mooncake",
            session_id,
            False,
            0,
        )
        assert not pub.write_digests  # released sglang's own: checked by /weights_checker
        assert len(pub.regions) == 19
        assert {name: (r.address, r.num_bytes) for name, r in pub.regions.items()} == {
            name: (address, numel * element_size)
            for name, (address, numel, element_size) in table.items()
        }
        replica_for(engine.server_info, 0, str(GPU_ANSWERS)).check_published(pub)
    finally:
        fleet.close_clients()


def test_connect_takes_the_nixl_plugins_vram_publication_from_a_gpu_server(
    replay: dict[str, dict[str, Any]],
) -> None:
    from p2pweights.replica.registry import replica_for
    from p2pweights.verification.check import serves_digests

    recorded = answers("gpu-qwen3-nixl", GPU_ANSWERS)
    url = "http://gpu-nixl.test:30000"
    replay[url] = recorded
    fleet = _connect(url, "nixl", GPU_ANSWERS)
    try:
        (engine,) = fleet.engines
        (pub,) = engine.publications
        assert (pub.backend, pub.live, pub.epoch, pub.mem_type) == ("nixl", True, 0, "VRAM")
        assert pub.agent_name and pub.agent_metadata
        assert len(flag_names(pub.regions)) == 19
        replica_for(engine.server_info, 0, str(GPU_ANSWERS)).check_published(pub)
        assert serves_digests(engine)  # checked by the plugin's write digests
    finally:
        fleet.close_clients()


def test_the_cuda_ipc_plugins_publication_from_a_gpu_server_is_read_as_its_transport_reads_it(
    replay: dict[str, dict[str, Any]],
) -> None:
    """Connect takes the publication and the CUDA IPC transport's checks before it opens
    a handle pass: every parameter lies inside one published segment, segments of one
    allocation agree on its start, and the engine is on the trainer's host (the colocated
    trainer's, as it was). Opening the handles needs the GPU that made them: the GPU
    suite does that part."""
    from p2pweights.replica.registry import replica_for
    from p2pweights.transports import cuda_ipc
    from p2pweights.verification.check import serves_digests

    recorded = answers("tp1-cuda-ipc", GPU_ANSWERS)
    info = recorded["publications"][0]["remote_instance_transfer_engine_info"]
    url = "http://gpu-cuda-ipc.test:30000"
    replay[url] = recorded
    fleet = _connect(url, "cuda_ipc", GPU_ANSWERS)
    try:
        (engine,) = fleet.engines
        (pub,) = engine.publications
        assert (pub.backend, pub.live, pub.epoch) == ("cuda_ipc", True, 0)
        assert (pub.agent_name, pub.host_id) == (info["agent_name"], info["host_id"])
        assert pub.write_digests and pub.digest_scheme == SCHEME and serves_digests(engine)
        assert len(pub.segments) == len(info["segments"]) == 8
        assert {len(s.handle) for s in pub.segments} == {64}
        assert {s.gpu_id for s in pub.segments} == {0}
        assert len({s.handle for s in pub.segments}) < len(pub.segments)  # shared allocations
        assert len(flag_names(pub.regions)) == 19
        replica_for(engine.server_info, 0, str(GPU_ANSWERS)).check_published(pub)
        cuda_ipc.check_segments(pub)
        cuda_ipc.check_reachable(pub, info["host_id"])
        with pytest.raises(ConfigError, match="not on this trainer's host"):
            cuda_ipc.check_reachable(pub, "another-host/boot")
    finally:
        fleet.close_clients()


@pytest.mark.parametrize("name", GPU_SERVERS)
def test_checksums_of_a_gpu_server_are_sglangs_64_bit_gpu_hashes(name: str) -> None:
    recorded = answers(name, GPU_ANSWERS)
    (rank0,) = checksums_by_rank(f"http://{name}.test:30000", recorded["/weights_checker"])
    info = recorded["publications"][0]["remote_instance_transfer_engine_info"]
    table = info[1] if isinstance(info, list) else info["weights_info_dict"]
    assert sorted(rank0) == flag_names(table)  # one per parameter, 19
    assert all(re.fullmatch(r"[0-9a-f]{16}", value) for value in rank0.values())


def test_gpu_servers_holding_the_same_update_answer_the_same_checksums() -> None:
    """Two servers, two transports, one seed's bytes: the same hashes; the CUDA IPC
    server, left on another seed, differs in every parameter."""
    ranks = {
        name: checksums_by_rank("http://x:1", answers(name, GPU_ANSWERS)["/weights_checker"])[0]
        for name in GPU_SERVERS
    }
    assert ranks["gpu-qwen3-mooncake-device"] == ranks["gpu-qwen3-nixl"]
    other = ranks["tp1-cuda-ipc"]
    assert all(other[n] != v for n, v in ranks["gpu-qwen3-nixl"].items())


def test_a_gpu_engine_is_checked_with_sglangs_gpu_hash_and_a_cpu_one_with_sha256(
    replay: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy that picks the checker's hash reads the device from the real server info:
    "cuda" for the GPU server (the sender then hashes its slots on CUDA with sglang's
    kernel), "cpu" for the CPU one (sha256). A trainer without CUDA cannot compute the GPU
    hash: the engine is updated unverified under "auto", refused under "always"."""
    from p2pweights.verification import checker
    from p2pweights.verification.check import WriteCheck

    gpu_url, cpu_url = "http://gpu-mooncake.test:30000", "http://tp1.test:30000"
    replay[gpu_url] = answers("gpu-qwen3-mooncake-device", GPU_ANSWERS)
    replay[cpu_url] = answers("tp1")
    gpu_fleet = _connect(gpu_url, "mooncake", GPU_ANSWERS)
    cpu_fleet = _connect(cpu_url, "nixl")
    try:
        (gpu,), (cpu,) = gpu_fleet.engines, cpu_fleet.engines
        assert (checker.checker_device(gpu), checker.checker_device(cpu)) == ("cuda", "cpu")
        assert checker.why_not(cpu) is None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert "no CUDA to compute the same hash" in str(checker.why_not(gpu))
        unverified = WriteCheck.connect([gpu], "auto")
        assert not unverified.checker and "no CUDA" in unverified.unverified[gpu_url]
        with pytest.raises(EngineError, match=rf"{gpu_url}: its writes cannot be verified"):
            WriteCheck.connect([gpu], "always")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert checker.why_not(gpu) is None
        check = WriteCheck.connect([gpu], "always")
        assert check.checker_devices == {gpu_url: "cuda"} and not check.engines
    finally:
        gpu_fleet.close_clients()
        cpu_fleet.close_clients()


def staged(name: str, folder: Path, seed: int) -> tuple[torch.Tensor, list[tuple[str, int, int]]]:
    """What a trainer stages for rank 0 of the recorded server ``name`` from seed ``seed``'s
    synthetic weights: one buffer the replica's loaders filled (as the sender's executor
    fills its staging buffers), and each parameter's (name, byte offset, byte length) in it."""
    from p2pweights.replica.registry import replica_for
    from p2pweights.testing import synthetic_weights

    config = json.loads((folder / "config.json").read_text())
    handle = replica_for(answers(name, folder)["/server_info"], 0, str(folder))
    slots, at = [], 0
    for param, layout in handle.layouts.items():
        slots.append((param, at, layout.num_bytes))
        at += layout.num_bytes
    buffer = torch.zeros(at, dtype=torch.uint8)
    views = {param: buffer[start : start + size] for param, start, size in slots}
    handle.load_into(list(synthetic_weights(config, seed)), views)
    return buffer, slots


def test_the_same_staged_bytes_hash_as_the_cpu_server_with_sha256_not_as_the_gpu_one() -> None:
    """The CPU and the GPU servers both ended on seed 13 and lay it out alike: the sender's
    hashes of one staging buffer for a CPU engine (sha256) are the CPU server's answer, and
    none is the GPU server's: a sender hashing on the wrong device would fail every
    parameter (the slow case below gets the GPU server's with sglang's GPU kernel)."""
    from p2pweights.verification.checksums import StagedChecksums
    from p2pweights.wire.publication import Runner

    buffer, slots = staged("tp1", ANSWERS, seed=13)
    gpu_buffer, gpu_slots = staged("gpu-qwen3-mooncake-device", GPU_ANSWERS, seed=13)
    assert torch.equal(buffer, gpu_buffer) and slots == gpu_slots
    url = "http://tp1.test:30000"
    runner = Runner(url, 0, "target")
    hashes = StagedChecksums({url: "cpu"})
    hashes.add_spans(buffer, [(param, at, size, [runner]) for param, at, size in slots])
    (cpu_answer,) = checksums_by_rank(url, answers("tp1")["/weights_checker"])
    assert hashes.found[runner] == cpu_answer
    (gpu_answer,) = checksums_by_rank(
        url, answers("gpu-qwen3-mooncake-device", GPU_ANSWERS)["/weights_checker"]
    )
    assert all(gpu_answer[param] != value for param, value in cpu_answer.items())


_GPU_HASH = textwrap.dedent(
    """
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"  # before sglang's kernel module is imported
    import torch
    from p2pweights.verification.checksums import StagedChecksums
    from p2pweights.wire.publication import Runner

    class OnCuda(torch.Tensor):
        # a staging buffer on the trainer's GPU, as far as Python asks: the sender keeps
        # it where it is and sglang's tensor_hash takes its GPU path (gpu_tensor_hash),
        # whose Triton kernels the interpreter runs on these CPU bytes
        @property
        def is_cuda(self):
            return True

        def cuda(self, *args, **kwargs):
            return self

    buffer = torch.load(BUFFER).as_subclass(OnCuda)
    runner = Runner(URL, 0, "target")
    hashes = StagedChecksums({URL: "cuda"})
    hashes.add_spans(buffer, [(param, at, size, [runner]) for param, at, size in SLOTS])
    got = hashes.found[runner]
    wrong = sorted(param for param in EXPECTED if got.get(param) != EXPECTED[param])
    print("ok" if got.keys() == EXPECTED.keys() and not wrong else f"differ: {wrong}")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpu-qwen3-mooncake-device", "tp1-cuda-ipc"])
def test_the_senders_gpu_hash_of_the_last_update_is_the_gpu_servers_answer(
    name: str, tmp_path: Path
) -> None:
    """The sender's hashes for a GPU engine (``StagedChecksums`` of a CUDA staging buffer:
    sglang's own ``gpu_tensor_hash`` Triton kernels, run here by Triton's interpreter) of
    the last update's staged bytes (seed 13; 11 for the CUDA IPC server) equal, all 19,
    what the GPU server's ``/weights_checker`` answered holding those weights: the checker
    comparison agrees with a real GPU engine. About 30 s each on an idle 2-core host
    (15 s of it importing sglang; the interpreter runs each 32 kB tile in numpy)."""
    from _interpreted import assert_prints_ok

    buffer, slots = staged(name, GPU_ANSWERS, seed=LAST_SEED[name])
    torch.save(buffer, tmp_path / "staged.pt")
    url = f"http://{name}.test:30000"
    (expected,) = checksums_by_rank(url, answers(name, GPU_ANSWERS)["/weights_checker"])
    settings = (
        f"BUFFER, URL = {str(tmp_path / 'staged.pt')!r}, {url!r}\n"
        f"SLOTS, EXPECTED = {slots!r}, {expected!r}\n"
    )
    assert_prints_ok(settings + _GPU_HASH)
