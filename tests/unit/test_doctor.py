"""``p2pweights doctor``: findings from a fake sysfs and a fake engine, and the exit code."""

from __future__ import annotations

import base64
import importlib.metadata
from pathlib import Path

import httpx
import pytest
import torch

from p2pweights import doctor
from p2pweights import doctor as doctor_module
from p2pweights.doctor import (
    FAIL,
    OK,
    WARN,
    Finding,
    engine_findings,
    install_hint,
    rdma_devices,
    wanted_distribution,
)
from p2pweights.engines.client import EngineClient
from p2pweights.transports.cuda_ipc import host_id

SGLANG = importlib.metadata.version("sglang")


def test_rdma_devices_and_their_port_state(tmp_path: Path) -> None:
    for name, state in [("mlx5_0", "4: ACTIVE"), ("mlx5_1", "1: DOWN")]:
        port = tmp_path / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
    assert rdma_devices(tmp_path) == [("mlx5_0", "4: ACTIVE"), ("mlx5_1", "1: DOWN")]
    assert rdma_devices(tmp_path / "none") == []


def test_exit_code_is_one_on_a_blocker(monkeypatch, capsys) -> None:
    found = [Finding("sglang", OK, "0.5.23"), Finding("nixl", WARN, "not importable")]
    monkeypatch.setattr(doctor, "host_findings", lambda *a: list(found))
    assert doctor.run_doctor() == 0
    found.append(Finding("transports", FAIL, "neither"))
    assert doctor.run_doctor() == 1
    out = capsys.readouterr().out
    assert "FAIL  transports" in out and "1 blocker(s)" in out


def _engine(
    url: str,
    *,
    version: str = SGLANG,
    session: str = "10.0.0.5:15000",
    publication: dict | None = None,
    routes: tuple[str, ...] = ("/begin_weight_update", "/end_weight_update"),
    weight_version: str = "7",
    model_path: str = "m",
) -> tuple[EngineClient, httpx.Client]:
    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/server_info":
            info = {"version": version, "tp_size": 2, "model_path": model_path}
            return httpx.Response(200, json=info)
        if path == "/remote_instance_transfer_engine_info":
            info = publication or [session, {"w": [4096, 4, 2]}]
            return httpx.Response(200, json={"remote_instance_transfer_engine_info": info})
        if path == "/model_info":
            return httpx.Response(200, json={"weight_version": weight_version})
        if path == "/openapi.json":
            return httpx.Response(200, json={"paths": {r: {} for r in routes}})
        return httpx.Response(404)

    mock = httpx.MockTransport(handle)
    client = EngineClient(url, timeout_s=1.0)
    client._http = httpx.Client(base_url=url, transport=mock)
    return client, httpx.Client(transport=mock)


def _by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check.removeprefix("engine http://10.0.0.5:30000").strip(): f for f in findings}


def test_an_engine_this_host_can_update() -> None:
    url = "http://10.0.0.5:30000"
    client, http = _engine(url)
    found = _by_check(engine_findings(url, client=client, http=http))
    assert [found[c].status for c in ("sglang", "update API", "rank 0", "rank 1", "state")] == [
        OK
    ] * 5
    assert "2 rank(s)" in found["layout"].detail


@pytest.mark.parametrize(
    ("options", "check", "status", "says"),
    [
        ({"version": "0.5.20"}, "sglang", FAIL, "runs sglang 0.5.20"),
        ({"routes": ("/generate",)}, "update API", FAIL, "/begin_weight_update"),
        ({"session": "127.0.0.1:15000"}, "rank 0", FAIL, "loopback address"),
        ({"weight_version": "p2pweights-updating:8"}, "state", WARN, "did not finish"),
    ],
)
def test_what_an_engine_check_finds(options: dict, check: str, status: str, says: str) -> None:
    url = "http://10.0.0.5:30000"
    client, http = _engine(url, **options)
    finding = _by_check(engine_findings(url, client=client, http=http))[check]
    assert finding.status == status
    assert says in finding.detail


def test_an_engine_that_does_not_answer() -> None:
    url = "http://10.0.0.5:30000"
    client = EngineClient(url, timeout_s=1.0)
    client._http = httpx.Client(
        base_url=url, transport=httpx.MockTransport(lambda r: httpx.Response(503))
    )
    (finding,) = engine_findings(url, client=client, http=httpx.Client())
    assert finding.status == FAIL and "no server info" in finding.detail


def _ipc_publication(host: str) -> dict:
    handle = base64.b64encode(bytes(64)).decode()
    segment = {"address": 4096, "num_bytes": 8, "gpu_id": 1, "handle": handle, "offset": 0}
    return {
        "backend": "cuda_ipc",
        "agent_name": "cuda_ipc_weight_tp0_1_x",
        "host_id": host,
        "segments": [segment],
        "weights_info_dict": {"w": [4096, 4, 2, 1]},
    }


def test_a_cuda_ipc_engine_on_another_host_is_a_blocker() -> None:
    url = "http://10.0.0.5:30000"
    client, http = _engine(url, publication=_ipc_publication("node-9/boot"))
    finding = _by_check(engine_findings(url, client=client, http=http))["rank 0"]
    assert finding.status == FAIL
    assert "node-9/boot" in finding.detail and "mooncake or nixl" in finding.detail


def test_a_cuda_ipc_engine_on_this_host_needs_a_gpu_here() -> None:
    url = "http://10.0.0.5:30000"
    client, http = _engine(url, publication=_ipc_publication(host_id()))
    finding = _by_check(engine_findings(url, client=client, http=http))["rank 0"]
    if torch.cuda.is_available():
        assert finding.status == OK
    else:
        assert finding.status == FAIL and "no CUDA device" in finding.detail


@pytest.mark.parametrize(("gpu", "status"), [(True, doctor.WARN), (False, doctor.FAIL)])
def test_no_rdma_transport_is_a_blocker_only_without_a_gpu(monkeypatch, gpu, status) -> None:
    """Found on the H200 machine: with neither Mooncake nor NIXL but a GPU, CudaIpcConfig
    still updates engines on this host; doctor called that a blocker."""
    missing = {
        kind: doctor.Finding(kind, doctor.WARN, "not importable") for kind in ("mooncake", "nixl")
    }
    monkeypatch.setattr(doctor, "_transport_import", lambda kind: missing[kind])
    cuda = doctor.Finding("CUDA", doctor.OK, "1 device(s)") if gpu else doctor._cuda()
    monkeypatch.setattr(doctor, "_cuda", lambda: cuda)
    found = {f.check: f for f in doctor.host_findings(1 << 20, loopback=False)}
    assert found["transports"].status == status
    if gpu:
        assert "CudaIpcConfig" in found["transports"].detail


def test_what_doctor_opens_for_an_engine_it_closes_even_when_it_does_not_answer(
    monkeypatch,
) -> None:
    opened: list[httpx.Client] = []
    real = httpx.Client

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs):
            kwargs["transport"] = httpx.MockTransport(lambda r: httpx.Response(503))
            super().__init__(**kwargs)
            opened.append(self)

    monkeypatch.setattr(doctor_module.httpx, "Client", Recording)
    (finding,) = engine_findings("http://10.0.0.5:30000", timeout_s=1.0)
    assert finding.status == FAIL
    assert len(opened) == 2 and all(c.is_closed for c in opened)  # its client and http


@pytest.mark.parametrize(
    ("kind", "cuda", "gpu", "wanted"),
    [
        ("mooncake", None, False, "mooncake-transfer-engine-non-cuda"),
        ("mooncake", "13.0", False, "mooncake-transfer-engine-non-cuda"),  # CUDA torch, no GPU
        ("mooncake", "13.0", True, "mooncake-transfer-engine-cuda13"),
        ("mooncake", "12.8", True, "mooncake-transfer-engine"),
        ("nixl", "12.4", True, "nixl-cu12"),
        ("nixl", "13.0", False, "nixl-cu13"),
    ],
)
def test_the_build_a_host_needs(kind, cuda, gpu, wanted) -> None:
    assert wanted_distribution(kind, cuda, gpu) == wanted


def test_the_fix_doctor_suggests_replaces_a_build_that_does_not_load() -> None:
    """The bug: a CPU host with the CUDA 12 Mooncake build was told to install it."""
    error = ImportError("libcudart.so.12: cannot open shared object file")
    cpu = "mooncake-transfer-engine-non-cuda"  # this development machine has no GPU
    assert install_hint("mooncake", error, ["mooncake-transfer-engine"]) == (
        f"pip uninstall -y mooncake-transfer-engine; pip install {cpu}"
    )
    assert install_hint("mooncake", error, []) == f"pip install {cpu}"
    assert "installed but does not load" in install_hint("mooncake", error, [cpu])
    missing_libs = ImportError("libibverbs.so.1: cannot open shared object file")
    assert install_hint("mooncake", missing_libs, []).startswith("apt-get install libibverbs1")
    assert (
        install_hint("nixl", ImportError("x"), ["nixl"]) == "pip install --no-deps nixl nixl-cu13"
    )


def test_doctor_counts_parameters_as_inspect_does_without_the_delta_scratch() -> None:
    from p2pweights.wire.delta import SCRATCH_NAME

    url = "http://10.0.0.5:30000"
    table = {"a": [4096, 4, 2], "b": [8192, 4, 2], SCRATCH_NAME: [16384, 64, 1]}
    client, http = _engine(url, publication=["10.0.0.5:15000", table])
    finding = _by_check(engine_findings(url, client=client, http=http))["rank 0"]
    assert "publishes 2 parameters" in finding.detail


def test_doctor_checks_memory_for_the_buffers_sync_config_uses_by_default() -> None:
    from p2pweights.cli import build_parser
    from p2pweights.config import SyncConfig, parse_bytes

    args = build_parser().parse_args(["doctor"])
    assert parse_bytes(args.buffer) == SyncConfig().buffer_bytes


def test_doctor_reads_the_engines_model_config_as_connect_does(tmp_path, monkeypatch) -> None:
    """An engine started from another directory with a relative --model publishes a path
    this host cannot read: doctor says so, as connect() would (issue 41 item 10)."""
    from p2pweights.testing import write_model_dir

    url = "http://10.0.0.5:30000"
    folder = write_model_dir("qwen3-tiny", tmp_path / "qwen3-tiny")
    client, http = _engine(url, model_path=str(folder))
    found = _by_check(engine_findings(url, client=client, http=http))["model config"]
    assert found.status == OK and str(folder) in found.detail
    monkeypatch.chdir(tmp_path.parent)  # elsewhere: the relative path names nothing
    client, http = _engine(url, model_path="qwen3-tiny")
    found = _by_check(engine_findings(url, client=client, http=http))["model config"]
    assert found.status == FAIL and "EngineEndpoint(url, model_path=" in found.detail


def test_the_local_engine_publishes_an_absolute_model_path(tmp_path, monkeypatch) -> None:
    from p2pweights.local_engine.serve import model_folder
    from p2pweights.testing import write_model_dir

    write_model_dir("qwen3-tiny", tmp_path / "qwen3-tiny")
    monkeypatch.chdir(tmp_path)
    assert model_folder("qwen3-tiny") == tmp_path / "qwen3-tiny"
    assert model_folder("qwen3-tiny").is_absolute()
    assert model_folder("qwen3-tiny/config.json") == tmp_path / "qwen3-tiny"
