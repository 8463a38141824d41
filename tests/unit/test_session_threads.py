"""connect, update, abort and close called from two threads at once (issue 28, item 3).

What each does while another runs (``WeightSyncSession``'s docstring says it too):

* ``update()`` and ``connect()`` are refused with ``SessionBusyError`` (a
  ``ConfigError``) naming the call that runs, doing nothing: a second update or a
  reconnect under a running update would tear the state it reads;
* ``abort()`` and ``close()`` never refuse: a running update is cancelled (it raises
  ``TransferError``), any other running call is waited for, then they do their work.

Each pair runs against the fake engines, replicas and transport of
test_session_sequence (unit level); the running call is held at a point inside it by
a gate, the other call is made, then the gate opens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from test_session_sequence import (  # the fixture is used by name
    CONFIG,
    FakeClient,
    _holds,
    _tensors,
    engines,  # noqa: F401
)

from p2pweights import ConfigError, TransferError, WeightSyncSession
from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import SessionBusyError

URL = "http://e0"
WAIT_S = 10


class Gate:
    """Holds the first thread that reaches it until ``open()``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._open = threading.Event()
        self.armed = False

    def __call__(self) -> None:
        if self.armed:
            self.armed = False
            self.reached.set()
            assert self._open.wait(WAIT_S), "the gate was never opened"

    def open(self) -> None:
        self._open.set()


class Running:
    """A call of the session running on a thread of its own, held at a gate."""

    def __init__(self, call: Callable[[], object], gate: Gate):
        self.gate = gate
        self.result: object = None
        self.error: BaseException | None = None
        gate.armed = True
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()
        assert gate.reached.wait(WAIT_S), "the running call never reached its gate"

    def _run(self, call: Callable[[], object]) -> None:
        try:
            self.result = call()
        except BaseException as exc:
            self.error = exc

    def finish(self) -> None:
        self.gate.open()
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


@pytest.fixture
def gates(engines, monkeypatch) -> dict[str, Gate]:  # noqa: F811
    """Gates in the fake engine's calls: "server_info" holds connect(), "end" holds
    the end of an update session (abort() and close() of a failed update end it)."""
    gates = {"server_info": Gate(), "end": Gate()}

    class GatedClient(FakeClient):
        def server_info(self):
            gates["server_info"]()
            return super().server_info()

        def end_weight_update(self):
            gates["end"]()
            return super().end_weight_update()

    def client_for(url, **kwargs):
        from test_session_sequence import FakeEngine

        return GatedClient(engines.setdefault(url, FakeEngine(url)))

    monkeypatch.setattr(fleet_module, "EngineClient", client_for)
    return gates


def _held_stream(value: int, gate: Gate) -> Iterator:
    """An update's tensors, then held at the gate before the stream ends ("o" did not fit
    beside q, k, v: the engine opened and q, k, v were written; "o" is staged)."""
    yield from _tensors(value)
    gate()


def _running_update(session: WeightSyncSession, value: int) -> Running:
    gate = Gate()
    return Running(lambda: session.update(_held_stream(value, gate)), gate)


def _running_connect(session: WeightSyncSession, gates: dict[str, Gate]) -> Running:
    return Running(lambda: session.connect([URL]), gates["server_info"])


def _failed(session: WeightSyncSession, engines) -> None:  # noqa: F811
    """An update that failed with the engine open and torn (abort() and close() end it)."""
    engines[URL].inject[f"write{engines[URL].writes + 1}"] = "failed"
    with pytest.raises(TransferError):
        session.update(_tensors(9))
    assert engines[URL].open


def _running_abort(session: WeightSyncSession, gates: dict[str, Gate]) -> Running:
    return Running(session.abort, gates["end"])


def _running_close(session: WeightSyncSession, gates: dict[str, Gate]) -> Running:
    return Running(session.close, gates["end"])


@pytest.fixture
def session(engines, gates) -> Iterator[WeightSyncSession]:  # noqa: F811
    with WeightSyncSession(CONFIG) as session:
        session.connect([URL])
        session.update(_tensors(1))
        yield session


# -- update running --------------------------------------------------------------------------


def test_update_while_update_runs_is_refused_and_the_first_completes(session, engines):  # noqa: F811
    running = _running_update(session, 2)
    with pytest.raises(SessionBusyError, match=r"update\(\) is running"):
        session.update(_tensors(3))
    running.finish()
    assert running.error is None and _holds(engines[URL], 2)


def test_connect_while_update_runs_is_refused_and_the_update_completes(session, engines):  # noqa: F811
    running = _running_update(session, 2)
    with pytest.raises(SessionBusyError, match=r"connect\(\) refused: update\(\) is running"):
        session.connect([URL])
    running.finish()
    assert running.error is None, running.error  # not AttributeError on a torn-down plan
    engine = engines[URL]
    assert _holds(engine, 2) and engine.running and engine.version == "2"
    session.update(_tensors(3))  # still connected
    assert _holds(engine, 3)


def test_abort_while_update_runs_cancels_it(session, engines):  # noqa: F811
    running = _running_update(session, 2)
    aborter = threading.Thread(target=session.abort, daemon=True)
    aborter.start()
    while not session._cancel.is_set():  # abort() asked the update to stop
        threading.Event().wait(0.01)
    running.finish()
    aborter.join(WAIT_S)
    assert isinstance(running.error, TransferError), running.error
    assert "cancelled by abort()" in str(running.error)
    assert engines[URL].paused and engines[URL].version == f"{UPDATING_PREFIX}2"  # torn
    session.update(_tensors(3))  # the next update repairs it
    assert _holds(engines[URL], 3) and engines[URL].running


def test_close_while_update_runs_cancels_it_and_closes(session, engines):  # noqa: F811
    running = _running_update(session, 2)
    closer = threading.Thread(target=session.close, daemon=True)
    closer.start()
    while not session._cancel.is_set():
        threading.Event().wait(0.01)
    running.finish()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert isinstance(running.error, TransferError), running.error
    with pytest.raises(ConfigError, match="connect"):
        session.update(_tensors(3))  # closed: nothing connected


# -- connect running -------------------------------------------------------------------------


def test_update_while_connect_runs_is_refused(session, engines, gates):  # noqa: F811
    running = _running_connect(session, gates)
    with pytest.raises(SessionBusyError, match=r"update\(\) refused: connect\(\) is running"):
        session.update(_tensors(2))
    running.finish()
    assert running.error is None
    session.update(_tensors(3))
    assert _holds(engines[URL], 3)


def test_connect_while_connect_runs_is_refused(session, gates):
    running = _running_connect(session, gates)
    with pytest.raises(SessionBusyError, match=r"connect\(\) refused: connect\(\) is running"):
        session.connect([URL])
    running.finish()
    assert running.error is None


def test_abort_while_connect_runs_waits_for_it(session, engines, gates):  # noqa: F811
    running = _running_connect(session, gates)
    result: dict[str, object] = {}
    aborter = threading.Thread(target=lambda: result.setdefault("abort", session.abort()))
    aborter.start()
    aborter.join(0.2)
    assert aborter.is_alive()  # waits for the connect
    running.finish()
    aborter.join(WAIT_S)
    assert running.error is None and result["abort"].ok  # type: ignore[attr-defined]
    session.update(_tensors(3))  # the connect stands
    assert _holds(engines[URL], 3)


def test_close_while_connect_runs_waits_for_it(session, gates):
    running = _running_connect(session, gates)
    closer = threading.Thread(target=session.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()
    running.finish()
    closer.join(WAIT_S)
    assert not closer.is_alive() and running.error is None
    with pytest.raises(ConfigError, match="connect"):
        session.update(_tensors(3))


# -- abort or close running ------------------------------------------------------------------


def test_update_while_abort_runs_is_refused_saying_so(session, engines, gates):  # noqa: F811
    _failed(session, engines)
    running = _running_abort(session, gates)
    with pytest.raises(SessionBusyError, match=r"update\(\) refused: abort\(\) is running"):
        session.update(_tensors(3))
    running.finish()
    assert running.error is None
    session.update(_tensors(3))
    assert _holds(engines[URL], 3) and engines[URL].running


def test_connect_while_abort_runs_is_refused(session, engines, gates):  # noqa: F811
    _failed(session, engines)
    running = _running_abort(session, gates)
    with pytest.raises(SessionBusyError, match=r"connect\(\) refused: abort\(\) is running"):
        session.connect([URL])
    running.finish()
    assert running.error is None


def test_abort_while_abort_runs_waits_and_then_aborts(session, engines, gates):  # noqa: F811
    _failed(session, engines)
    running = _running_abort(session, gates)
    report = {}
    second = threading.Thread(target=lambda: report.setdefault("abort", session.abort()))
    second.start()
    second.join(0.2)
    assert second.is_alive()
    running.finish()
    second.join(WAIT_S)
    assert not second.is_alive() and "abort" in report
    assert not engines[URL].open


def test_update_and_connect_while_close_runs_are_refused(session, engines, gates):  # noqa: F811
    _failed(session, engines)
    running = _running_close(session, gates)
    with pytest.raises(SessionBusyError, match=r"update\(\) refused: close\(\) is running"):
        session.update(_tensors(3))
    with pytest.raises(SessionBusyError, match=r"connect\(\) refused: close\(\) is running"):
        session.connect([URL])
    running.finish()
    assert running.error is None


def test_close_while_abort_runs_waits_and_closes(session, engines, gates):  # noqa: F811
    _failed(session, engines)
    running = _running_abort(session, gates)
    closer = threading.Thread(target=session.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()
    running.finish()
    closer.join(WAIT_S)
    assert not closer.is_alive() and running.error is None


# -- on the running call's own thread --------------------------------------------------------


def test_calls_from_inside_an_update_on_its_own_thread_are_refused(session, engines):  # noqa: F811
    """From the input iterator (or a signal handler) on the update's own thread: refused,
    never a deadlock; abort() and close() cancel the update."""
    seen: dict[str, BaseException] = {}

    def stream():
        pairs = _tensors(2)
        yield from pairs[:3]
        for name, call in [
            ("connect", lambda: session.connect([URL])),
            ("update", lambda: session.update(_tensors(4))),
            ("abort", session.abort),
        ]:
            try:
                call()
            except BaseException as exc:
                seen[name] = exc
        yield pairs[3]

    with pytest.raises(TransferError, match=r"cancelled by abort\(\)"):
        session.update(stream())
    assert isinstance(seen["connect"], SessionBusyError)
    assert isinstance(seen["update"], SessionBusyError)
    assert isinstance(seen["abort"], SessionBusyError)
    assert "on its own thread" in str(seen["abort"])
    session.update(_tensors(5))
    assert _holds(engines[URL], 5)


def test_a_loop_of_updates_cannot_starve_abort():
    """A thread calling update() in a loop re-takes the session the moment each update
    returns; abort() must still get in at once, cancelling the update it finds (or that
    starts) and refusing the next, never waiting out a whole update (issue 39 item 9)."""
    import time

    from p2pweights.errors import SessionBusyError
    from p2pweights.one_call import OneCall

    one = OneCall()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                with one.refusing("update"):
                    one.cancel.wait(1.0)  # an update of 1 s, unless cancelled
            except SessionBusyError:
                pass  # refused while abort() waits: tries again at once

    looping = threading.Thread(target=loop)
    looping.start()
    waits = []
    try:
        time.sleep(0.1)  # an update is running
        for _ in range(50):
            started = time.monotonic()
            with one.waiting("abort"):
                pass
            waits.append(time.monotonic() - started)
            time.sleep(0.001)  # the loop starts its next update meanwhile
    finally:
        stop.set()
        looping.join(5)
    assert max(waits) < 0.5, f"abort() waited out a whole update: {max(waits):.2f} s"
