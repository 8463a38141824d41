"""``p2pweights inspect``: what an engine publishes, read over a mocked HTTP client."""

from __future__ import annotations

import httpx

from p2pweights.engines.client import EngineClient
from p2pweights.engines.inspect import describe_engine, render_inspection

URL = "http://127.0.0.1:30000"


def _client(
    server_info: dict, weight_version: str, broken_rank: int | None = None, scratch: bool = False
) -> EngineClient:
    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/server_info":
            return httpx.Response(200, json=server_info)
        if path == "/model_info":
            return httpx.Response(200, json={"weight_version": weight_version})
        if path == "/remote_instance_transfer_engine_info":
            rank = int(request.url.params["rank"])
            if rank == broken_rank:
                return httpx.Response(400, json={"error": {"message": f"no rank {rank}"}})
            table = {"model.embed_tokens.weight": [4096, 500, 2], "lm_head.weight": [8192, 500, 2]}
            if scratch:  # delta updates' scratch region: published, not a weight
                table["__p2pweights_delta_scratch__"] = [16384, 256, 1]
            return httpx.Response(
                200,
                json={
                    "rank": rank,
                    "remote_instance_transfer_engine_info": [f"127.0.0.1:{1000 + rank}", table],
                },
            )
        return httpx.Response(404)

    client = EngineClient(URL, timeout_s=1.0)
    client._http = httpx.Client(base_url=URL, transport=httpx.MockTransport(handle))
    return client


INFO = {
    "version": "0.5.23",
    "model_path": "/models/qwen3",
    "dtype": "bfloat16",
    "tp_size": 2,
    "ep_size": 1,
    "pp_size": 1,
    "dp_size": 1,
    "enable_dp_attention": False,
    "p2pweights_engine_state": {"paused": True, "update_open": True},
}


def test_a_torn_engine_is_described_rank_by_rank():
    found = describe_engine(_client(INFO, "p2pweights-updating:7"))
    assert found["sglang_version"] == "0.5.23"
    assert found["layout"]["tp_size"] == 2 and found["layout"]["model_path"] == "/models/qwen3"
    assert found["transport"] == ["mooncake"]
    assert found["writable"] is True and found["problem"] is None
    assert [(r["rank"], r["peer"], r["parameters"], r["bytes"]) for r in found["ranks"]] == [
        (0, "127.0.0.1:1000", 2, 2000),
        (1, "127.0.0.1:1001", 2, 2000),
    ]
    assert found["bytes"] == 4000
    assert found["weight_version"] == "p2pweights-updating:7"
    assert found["update_state"] == {
        "mid_update": True,
        "updating_to": "7",
        "reported_by_engine": True,
        "paused": True,
        "update_open": True,
    }
    text = render_inspection(found)
    assert "mid-update to 7 (weights may be torn)" in text
    assert "rank 1: mooncake 127.0.0.1:1001, 2 parameters" in text


def test_what_connect_would_refuse_is_said_and_unreadable_ranks_are_shown():
    info = {**INFO, "pp_size": 2}
    info.pop("p2pweights_engine_state")
    found = describe_engine(_client(info, "3", broken_rank=1))
    assert found["writable"] is False
    assert "pp_size=2" in found["problem"]
    assert "no rank 1" in found["ranks"][1]["error"]
    assert found["update_state"] == {"mid_update": False, "reported_by_engine": False}
    text = render_inspection(found)
    assert "writable by p2pweights: no: " in text
    assert "rank 1: unreadable" in text
    assert "3 (whole)" in text


def test_the_delta_scratch_region_is_not_counted_as_weights():
    found = describe_engine(_client(INFO, "3", scratch=True))
    assert [(r["parameters"], r["bytes"], r["delta_scratch_bytes"]) for r in found["ranks"]] == [
        (2, 2000, 256),
        (2, 2000, 256),
    ]
