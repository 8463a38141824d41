"""Engines refused at connect, before any byte moves, each naming the engine and what to do."""

from __future__ import annotations

import importlib.metadata

import httpx
import pytest

from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.client import EngineClient
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectOptions, connect_engine
from p2pweights.errors import EngineError

URL = "http://127.0.0.1:30000"
SGLANG = importlib.metadata.version("sglang")
PUBLICATION = {
    "rank": 0,
    "remote_instance_transfer_engine_info": ["127.0.0.1:1", {"w": [4096, 8, 2]}],
}


def _engine(monkeypatch, server_info: dict) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json=server_info)
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": "default"})
        rank = int(request.url.params["rank"])  # an engine answers for the rank asked
        return httpx.Response(200, json=PUBLICATION | {"rank": rank})

    def client(url, **kwargs):
        made = EngineClient(url, **kwargs)
        made._http = httpx.Client(base_url=url, transport=httpx.MockTransport(handler))
        return made

    monkeypatch.setattr(fleet_module, "EngineClient", client)


def _connect(allow_mismatch: bool = False):
    options = ConnectOptions("mooncake", 5.0, 5.0, None, allow_mismatch)
    return connect_engine(0, EngineEndpoint(URL), options)


def test_a_well_formed_engine_connects(monkeypatch):
    _engine(monkeypatch, {"tp_size": 1, "version": SGLANG})
    engine = _connect()
    assert engine.num_ranks == 1 and engine.update.phase.value == "running"


def test_data_parallel_replicas_in_one_server_are_refused(monkeypatch):
    _engine(monkeypatch, {"tp_size": 2, "dp_size": 2, "version": SGLANG})
    with pytest.raises(
        EngineError,
        match=rf"engine {URL}: dp_size=2 without DP attention.*"
        r"one server per replica",
    ):
        _connect()


def test_dp_attention_is_not_a_replica(monkeypatch):
    info = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "version": SGLANG}
    _engine(monkeypatch, info)
    assert _connect().num_ranks == 2


@pytest.mark.parametrize("theirs", ["0.5.21", None])
def test_another_sglang_release_is_refused_unless_allowed(monkeypatch, caplog, theirs):
    info = {"tp_size": 1} | ({"version": theirs} if theirs else {})
    _engine(monkeypatch, info)
    with pytest.raises(EngineError, match=rf"engine {URL} runs sglang .*allow_sglang_mismatch"):
        _connect()
    assert _connect(allow_mismatch=True).num_ranks == 1
    assert "allowed by allow_sglang_mismatch" in caplog.text


def test_pipeline_stages_are_refused(monkeypatch):
    _engine(monkeypatch, {"tp_size": 1, "pp_size": 2, "version": SGLANG})
    with pytest.raises(EngineError, match="pp_size=2"):
        _connect()
