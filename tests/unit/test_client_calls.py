"""The client records every call (route, time, new connection) and keeps connections alive.

The connection tests run a small HTTP/1.1 server on localhost that counts the TCP
connections it accepts (keep-alive as sglang's uvicorn serves it).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from p2pweights.engines import client as client_module
from p2pweights.engines.client import EngineClient
from p2pweights.engines.concurrency import at_once
from p2pweights.errors import EngineUnreachable

URL = "http://127.0.0.1:30000"


class Ticks:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _mocked(handler, clock) -> EngineClient:
    client = EngineClient(URL, timeout_s=1.0, clock=clock)
    client._http = httpx.Client(base_url=URL, transport=httpx.MockTransport(handler))
    return client


def test_every_call_is_recorded_with_its_route_and_time():
    answers = iter([400, 400, 200])

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/flush_cache":
            return httpx.Response(next(answers), text="busy")
        return httpx.Response(200, json={"success": True, "status": "ok"})

    client = _mocked(answer, Ticks())
    client.pause_generation("abort")
    client.flush_cache()  # refused twice while requests run, then flushed: three calls
    client.update_weight_version("2")
    calls = client.calls.calls()
    assert [c.route for c in calls] == [
        "POST /pause_generation",
        "GET /flush_cache",
        "GET /flush_cache",
        "GET /flush_cache",
        "POST /update_weight_version",
    ]
    assert all(c.url == URL and c.seconds == 1.0 for c in calls)
    assert not any(c.new_connection for c in calls)  # a mock transport opens none


def test_a_call_without_an_answer_is_recorded_too():
    client = EngineClient("http://127.0.0.1:9", timeout_s=1.0)
    with pytest.raises(EngineUnreachable):
        client.continue_generation()
    (call,) = client.calls.calls()
    assert call.route == "POST /continue_generation" and call.ended >= call.started


class _Counting(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    connections = 0
    answered: threading.Event

    def setup(self) -> None:
        type(self).connections += 1
        super().setup()

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = json.dumps({"success": True, "status": "ok", "weight_version": "1"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.answered.set()

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[type[_Counting]]:
    handler = type("Handler", (_Counting,), {"connections": 0, "answered": threading.Event()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{httpd.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    httpd.shutdown()
    httpd.server_close()


def test_the_reachability_check_readies_two_connections_the_update_reuses(server, monkeypatch):
    def staggered(first, *others):
        """The second check is sent only once the first was answered and had time to
        return: it would take the first's connection unless the first holds it."""
        worker = threading.Thread(target=first)
        worker.start()
        assert server.answered.wait(5)
        worker.join(1.0)  # a first that holds its connection is still waiting here
        for other in others:
            other()
        worker.join()

    monkeypatch.setattr(client_module, "at_once", staggered)
    client = EngineClient(server.url, timeout_s=5.0)  # type: ignore[attr-defined]
    client.check_reachable(connections=2)
    monkeypatch.undo()
    assert server.connections == 2
    client.pause_generation("abort")
    at_once(lambda: client.update_weight_version("p2pweights-updating:2"), client.flush_cache)
    client.begin_weight_update()
    client.end_weight_update()
    client.update_weight_version("2")
    client.continue_generation()
    client.close()
    assert server.connections == 2  # every later call went over a kept-alive connection
    calls = client.calls.calls()
    assert len(calls) == 9
    assert [c.route for c in calls if c.new_connection] == ["GET /model_info"] * 2


def test_one_connection_serves_calls_made_one_after_another(server):
    client = EngineClient(server.url, timeout_s=5.0)  # type: ignore[attr-defined]
    client.check_reachable()
    for _ in range(3):
        client.pause_generation("abort")
        client.continue_generation()
    client.close()
    assert server.connections == 1
    assert sum(c.new_connection for c in client.calls.calls()) == 1


def test_a_reachability_check_on_two_connections_fails_as_one_would():
    client = EngineClient("http://127.0.0.1:9", timeout_s=5.0)
    with pytest.raises(EngineUnreachable, match=r"127\.0\.0\.1:9: GET /model_info failed"):
        client.check_reachable(connections=2)
    assert [c.route for c in client.calls.calls()] == ["GET /model_info"] * 2
