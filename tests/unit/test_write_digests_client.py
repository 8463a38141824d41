"""Reading an engine rank's write-digest record: from the engine's route where it
answers the role (the local engine), else from the info bootstrap server on the engine's
host (sglang's route forwards only the rank; the plugin PUTs the record there)."""

from __future__ import annotations

import httpx
import pytest

from p2pweights.engines.client import EngineClient
from p2pweights.errors import EngineError
from p2pweights.wire.publication import DIGESTS_ROLE

RECORD = {"update": 3, "role": "target", "digests": {"w": "ab"}, "error": None}


def _client(handler) -> tuple[EngineClient, list[str]]:
    seen: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return handler(request)

    return EngineClient("http://engine:30000", transport=httpx.MockTransport(record)), seen


def test_the_engine_route_answers_the_record():
    def engine(request):
        assert request.url.params["role"] == DIGESTS_ROLE
        body = {"rank": 1, "role": DIGESTS_ROLE, "remote_instance_transfer_engine_info": RECORD}
        return httpx.Response(200, json=body)

    client, seen = _client(engine)
    assert client.write_digests(1, bootstrap_port=6789) == RECORD
    assert len(seen) == 1


def test_sglang_answers_the_publication_so_the_bootstrap_server_is_asked():
    def route(request):
        if request.url.port == 6789:
            assert request.url.path == "/get_transfer_engine_info"
            assert request.url.host == "engine" and request.url.params["rank"] == "0"
            body = {"rank": 0, "role": DIGESTS_ROLE, "remote_instance_transfer_engine_info": RECORD}
            return httpx.Response(200, json=body)
        publication = {"backend": "nixl", "weights_info_dict": {}}
        return httpx.Response(
            200, json={"rank": 0, "remote_instance_transfer_engine_info": publication}
        )

    client, seen = _client(route)
    assert client.write_digests(0, bootstrap_port=6789) == RECORD
    assert seen[-1].startswith("http://engine:6789/get_transfer_engine_info?")


def test_an_engine_without_records_is_named():
    def route(request):
        return httpx.Response(
            200, json={"rank": 0, "remote_instance_transfer_engine_info": ["s", {}]}
        )

    client, _ = _client(route)
    with pytest.raises(EngineError, match="http://engine:30000 rank 0: serves no write digests"):
        client.write_digests(0)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_the_api_key_never_goes_to_the_bootstrap_server(scheme):
    """The bootstrap port is plain HTTP and checks no key: the engine's API key (sent
    over https to the engine) must not travel there in clear (issue 39 item 9)."""
    keys: dict[int | None, str | None] = {}

    def route(request):
        keys[request.url.port] = request.headers.get("Authorization")
        if request.url.port == 6789:
            body = {"rank": 0, "role": DIGESTS_ROLE, "remote_instance_transfer_engine_info": RECORD}
            return httpx.Response(200, json=body)
        return httpx.Response(200, json={"rank": 0, "remote_instance_transfer_engine_info": {}})

    client = EngineClient(
        f"{scheme}://engine:30000", api_key="s3cret", transport=httpx.MockTransport(route)
    )
    assert client.write_digests(0, bootstrap_port=6789) == RECORD
    assert keys[30000] == "Bearer s3cret" and keys[6789] is None
