"""The sglang client against the routes' JSON shapes, over httpx's mock transport."""

from __future__ import annotations

import json

import httpx
import pytest

from p2pweights.engines.client import EngineClient
from p2pweights.errors import EngineError

URL = "http://127.0.0.1:30000"


def _client(handler) -> tuple[EngineClient, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    client = EngineClient(URL, timeout_s=1.0, api_key="secret")
    client._http = httpx.Client(
        base_url=URL, transport=httpx.MockTransport(record), headers=client._http.headers
    )
    return client, seen


def test_mooncake_publication_is_parsed():
    body = {
        "rank": 1,
        "remote_instance_transfer_engine_info": [
            "127.0.0.1:12345",
            {"model.embed_tokens.weight": [4096, 100, 2], "lm_head.weight": [8192, 10, 4]},
        ],
    }
    client, seen = _client(lambda r: httpx.Response(200, json=body))
    pub = client.publication(1)
    assert seen[0].url.path == "/remote_instance_transfer_engine_info"
    assert seen[0].url.params["rank"] == "1"
    assert seen[0].headers["authorization"] == "Bearer secret"
    assert pub.backend == "mooncake" and pub.session_id == "127.0.0.1:12345"
    assert pub.regions["model.embed_tokens.weight"].address == 4096
    assert pub.regions["model.embed_tokens.weight"].num_bytes == 200
    assert pub.regions["lm_head.weight"].end == 8192 + 40


def test_nixl_publication_is_parsed():
    body = {
        "rank": 0,
        "remote_instance_transfer_engine_info": {
            "backend": "nixl",
            "agent_name": "nixl_weight_tp0_x",
            "agent_metadata": "aGVsbG8=",
            "weights_info_dict": {"w": [4096, 8, 2, 3]},
        },
    }
    client, _ = _client(lambda r: httpx.Response(200, json=body))
    pub = client.publication(0)
    assert (pub.backend, pub.peer, pub.agent_metadata) == ("nixl", "nixl_weight_tp0_x", b"hello")
    assert pub.regions["w"].gpu_id == 3


def test_draft_publication_is_asked_for_by_role():
    table = ["127.0.0.1:5", {"model.decoder.mlp.gate.weight": [4096, 8, 2]}]

    def answer(request: httpx.Request) -> httpx.Response:
        body = {"rank": 0, "remote_instance_transfer_engine_info": table}
        if request.url.params.get("role") == "draft":
            body["role"] = "draft"
        return httpx.Response(200, json=body)

    client, seen = _client(answer)
    pub = client.publication(0, role="draft")
    assert seen[0].url.params["role"] == "draft"
    assert pub.role == "draft" and pub.where == f"engine {URL} rank 0 (draft)"
    assert client.publication(0).role == "target"


def test_engine_that_cannot_publish_its_draft_apart_is_refused():
    """sglang 0.5.23 ignores ``role``: its one table per TP rank cannot be the draft's."""
    body = {"rank": 0, "remote_instance_transfer_engine_info": ["127.0.0.1:5", {}]}
    client, _ = _client(lambda r: httpx.Response(200, json=body))
    with pytest.raises(EngineError, match="does not publish its draft runner's weights apart"):
        client.publication(0, role="draft")


def test_missing_rank_names_url_route_and_message():
    client, _ = _client(
        lambda r: httpx.Response(400, json={"error": {"message": "rank 7 not found"}})
    )
    with pytest.raises(EngineError, match=r"127\.0\.0\.1:30000.*transfer_engine_info.*rank 7"):
        client.publication(7)


def test_unsuccessful_update_call_raises_with_engine_message():
    client, seen = _client(
        lambda r: httpx.Response(200, json={"success": False, "message": "not paused"})
    )
    with pytest.raises(EngineError, match="begin_weight_update failed: not paused"):
        client.begin_weight_update()
    assert json.loads(seen[0].content) == {"selector": "all"}


def test_update_session_bodies():
    client, seen = _client(lambda r: httpx.Response(200, json={"success": True, "status": "ok"}))
    client.pause_generation("retract")
    client.update_weight_version("7")
    client.end_weight_update()
    client.continue_generation()
    bodies = [(r.url.path, json.loads(r.content)) for r in seen]
    assert bodies == [
        ("/pause_generation", {"mode": "retract"}),
        ("/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
        ("/end_weight_update", {}),
        ("/continue_generation", {"torch_empty_cache": False}),
    ]


def test_flush_cache_retries_until_idle():
    answers = iter([400, 400, 200])
    client, seen = _client(lambda r: httpx.Response(next(answers), text="busy"))
    client.flush_cache()
    assert len(seen) == 3


def test_unreachable_engine():
    client = EngineClient("http://127.0.0.1:9", timeout_s=1.0)
    with pytest.raises(EngineError, match=r"127\.0\.0\.1:9: GET /server_info failed"):
        client.server_info()
