"""The NIXL plugin's pieces that need neither sglang nor NIXL: bootstrap server, PUT, skips."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from p2pweights.errors import EngineError
from p2pweights.local_engine.process import free_port
from p2pweights.sglang_plugin import publish_after_initialize
from p2pweights.sglang_plugin.bootstrap import NixlAwareBootstrapServer
from p2pweights.sglang_plugin.publish import put_publication

NIXL_INFO = {
    "backend": "nixl",
    "agent_name": "nixl_weight_tp1_abc",
    "agent_metadata": "bWV0YQ==",
    "weights_info_dict": {"lm_head.weight": [4096, 10, 2, 3]},
    "mem_type": "VRAM",
}


@pytest.fixture
def server() -> Iterator[NixlAwareBootstrapServer]:
    started = NixlAwareBootstrapServer("127.0.0.1", free_port())
    yield started
    started.close()


def _get(server: NixlAwareBootstrapServer, rank: int) -> httpx.Response:
    return httpx.get(f"{server.url}/get_transfer_engine_info", params={"rank": rank})


def test_mooncake_registrations_are_answered_as_sglang_answers_them(
    server: NixlAwareBootstrapServer,
) -> None:
    info = {"session_id": "10.0.0.1:1234", "weights_info_dict": {"w": [4096, 10, 2]}}
    response = httpx.put(
        f"{server.url}/register_transfer_engine_info",
        json={"tp_rank": 0, "transfer_engine_info": info},
    )
    assert response.status_code == 200
    assert _get(server, 0).json() == {
        "rank": 0,
        "remote_instance_transfer_engine_info": ["10.0.0.1:1234", {"w": [4096, 10, 2]}],
    }
    assert server.get_transfer_engine_info(0) == ("10.0.0.1:1234", {"w": [4096, 10, 2]})


def test_nixl_publications_are_answered_in_the_shape_of_sglang_pr_35712(
    server: NixlAwareBootstrapServer,
) -> None:
    put_publication(server.url, 1, NIXL_INFO, timeout_s=5)
    assert _get(server, 1).json() == {"rank": 1, "remote_instance_transfer_engine_info": NIXL_INFO}


@pytest.mark.parametrize(
    "body",
    [
        {"transfer_engine_info": NIXL_INFO},
        {"tp_rank": 0, "transfer_engine_info": {"backend": "nixl", "weights_info_dict": {}}},
        {"tp_rank": 0, "transfer_engine_info": {"weights_info_dict": {}}},
        {"tp_rank": 0, "transfer_engine_info": {**NIXL_INFO, "backend": "gloo"}},
    ],
    ids=["no-rank", "nixl-without-agent", "mooncake-without-session", "unknown-backend"],
)
def test_malformed_registrations_are_refused(server: NixlAwareBootstrapServer, body: dict) -> None:
    response = httpx.put(f"{server.url}/register_transfer_engine_info", json=body)
    assert response.status_code == 400
    assert server.transfer_engine_info == {}


def test_missing_and_invalid_ranks(server: NixlAwareBootstrapServer) -> None:
    assert _get(server, 0).status_code == 404
    assert _get(server, -1).status_code == 400


def test_a_taken_port_is_reported_with_the_fix(server: NixlAwareBootstrapServer) -> None:
    with pytest.raises(RuntimeError, match="--engine-info-bootstrap-port"):
        NixlAwareBootstrapServer("127.0.0.1", server.port)


def test_put_gives_up_on_a_server_that_never_answers() -> None:
    with pytest.raises(EngineError, match="did not answer within 1 s"):
        put_publication(f"http://127.0.0.1:{free_port()}", 0, NIXL_INFO, timeout_s=1)


def test_put_reports_a_refusal(server: NixlAwareBootstrapServer) -> None:
    with pytest.raises(EngineError, match="refused the NIXL publication"):
        put_publication(server.url, 0, {"backend": "nixl"}, timeout_s=5)


def test_draft_models_are_not_published() -> None:
    runner = SimpleNamespace(is_draft_worker=True)  # no model: publishing would fail
    assert publish_after_initialize(None, runner) is None


def test_importing_the_plugin_imports_neither_sglang_nor_nixl() -> None:
    code = (
        "import sys, p2pweights, p2pweights.sglang_plugin; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'nixl')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("setting", "digests"), [(None, True), ("1", True), ("0", False)])
def test_the_plugin_digests_its_writes_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, digests: bool
) -> None:
    import p2pweights.sglang_plugin as plugin
    from p2pweights.replica.sglang import facade
    from p2pweights.sglang_plugin import publish

    class Published:  # the NIXL registration, which needs NIXL, left out
        def __init__(self, engine_rank: int, backend: str, bootstrap_url: str) -> None:
            self.engine_rank = engine_rank

        def publish(self, model: object) -> None:
            pass

    if setting is None:
        monkeypatch.delenv("P2PWEIGHTS_WRITE_DIGESTS", raising=False)
    else:
        monkeypatch.setenv("P2PWEIGHTS_WRITE_DIGESTS", setting)
    monkeypatch.setattr(publish, "LivePublication", Published)
    monkeypatch.setattr(facade, "bootstrap_url", lambda: "http://127.0.0.1:1")
    transporter = SimpleNamespace(tp_rank=2)
    runner = SimpleNamespace(model=None, remote_instance_weight_transporter=transporter)
    try:
        publish_after_initialize(None, runner)
        side = plugin._sides[id(runner)]
        assert (side.engine_rank, side.write_digests) == (2, digests)
    finally:
        plugin._sides.pop(id(runner), None)
        plugin._published.pop(id(runner), None)


def test_a_record_put_inside_sglang_s_pause_is_one_short_attempt(caplog) -> None:
    """The begin-after and end-before hooks run inside sglang's scheduler on every TP rank:
    a bootstrap server that does not answer must not stall it (issue 39 item 4). One
    attempt with a short timeout, the failure logged; the trainer then finds no record
    for its update and fails it."""
    import socket
    import time

    from p2pweights.sglang_plugin.publish import HOOK_PUT_TIMEOUT_S, LivePublication

    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        published = LivePublication(0, "UCX", f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        published.put_record({"update": 3, "digests": {}})
        assert time.monotonic() - started < HOOK_PUT_TIMEOUT_S + 1.5
    finally:
        silent.close()
    assert "could not PUT its write-digest record" in caplog.text
    refused = LivePublication(0, "UCX", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    refused.put_record({"update": 3, "digests": {}})  # connection refused: not retried
    assert time.monotonic() - started < 1.0


def test_the_plugin_s_digest_record_carries_the_engine_s_weight_version(monkeypatch) -> None:
    """So that a trainer can tell this update's record from an earlier one's by more than
    its number (issue 39 item 9): the weight version sglang's scheduler holds at the end
    (``p2pweights-updating:<v>`` while the trainer writes)."""
    import torch

    from p2pweights import sglang_plugin as plugin
    from p2pweights.engine_side.steps import RankSide
    from p2pweights.replica.sglang import facade

    model = torch.nn.Linear(2, 2)
    runner = SimpleNamespace(model=model)
    updater = SimpleNamespace(get_model_runner=lambda: runner)
    put: list[dict] = []
    published = SimpleNamespace(scratch=None, put_record=put.append)
    side = RankSide(0, write_digests=True)
    side.after_begin()
    monkeypatch.setitem(plugin._sides, id(runner), side)
    monkeypatch.setitem(plugin._published, id(runner), published)
    serving = SimpleNamespace(weight_version="p2pweights-updating:7")
    monkeypatch.setattr(facade, "serving_args", lambda: serving)
    plugin.digests_before_end(updater)
    (record,) = put
    assert record["weight_version"] == "p2pweights-updating:7" and record["digests"]
