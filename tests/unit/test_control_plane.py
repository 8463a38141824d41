"""The update session's control calls: which overlap, which wait, what a failure in a
concurrent pair leaves, how long each engine stayed paused, and what they cost.

A recording fake client logs when each call starts and ends and moves an injected
clock one second per answer, so times are exact and no assertion reads a real clock.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from p2pweights.engines.calls import CallLog, ControlCall, ControlCalls
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectedEngine, Fleet
from p2pweights.engines.update_state import UPDATING_PREFIX, AbortReport, EngineUpdate, Phase
from p2pweights.errors import EngineError, EngineStateError, EngineUnreachable
from p2pweights.report import EngineReport, UpdateReport

OVERLAP_WAIT_S = 5.0  # bounds only a failing run: a pair issued one after another waits this


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordingClient:
    """The client calls ``EngineUpdate`` makes, each logged as ("start"|"end", step)."""

    def __init__(self, clock: Clock, url: str = "http://e0", version: str = "3"):
        self.url = url
        self.clock = clock
        self.version = version
        self.paused = False
        self.open = False
        self.log: list[tuple[str, str]] = []
        self.fail: dict[str, Exception] = {}
        """step -> raised before the step takes effect (one-shot)."""
        self.lost: set[str] = set()
        """Steps that take effect, then lose their answer (one-shot)."""
        self.meet: dict[str, str] = {}
        """step -> a step it waits to see started (proves the two overlap)."""
        self.met: dict[str, bool] = {}
        self.calls = CallLog()
        self.reachable_connections: list[int] = []
        self._started: dict[str, threading.Event] = defaultdict(threading.Event)
        self._lock = threading.Lock()

    def _step(self, step: str, effect=lambda: None) -> None:
        with self._lock:
            self.log.append(("start", step))
            self._started[step].set()
        if step in self.meet:
            self.met[step] = self._started[self.meet[step]].wait(OVERLAP_WAIT_S)
        error = self.fail.pop(step, None)
        if error is not None:
            raise error
        effect()
        with self._lock:
            self.clock.now += 1.0
            self.log.append(("end", step))
        if step in self.lost:
            self.lost.discard(step)
            raise EngineUnreachable(f"engine {self.url}: /{step} answer lost")

    def check_reachable(self, connections: int = 1) -> None:
        self.reachable_connections.append(connections)
        self._step("reachable")

    def weight_version(self) -> str:
        return self.version

    def engine_state(self) -> dict[str, bool] | None:
        return None  # as released sglang: no reported state

    def pause_generation(self, mode: str) -> None:
        self._step("pause", lambda: setattr(self, "paused", True))

    def flush_cache(self) -> None:
        self._step("flush")

    def update_weight_version(self, version: str) -> None:
        step = "marker" if version.startswith(UPDATING_PREFIX) else "version"
        self._step(step, lambda: setattr(self, "version", version))

    def weights_checker(self, action: str, **options) -> dict:
        self._step(action)
        return {"success": True}

    def begin_weight_update(self, selector: str = "all") -> None:
        self._step("begin", lambda: setattr(self, "open", True))

    def end_weight_update(self) -> dict:
        self._step("end", lambda: setattr(self, "open", False))
        return {}

    def continue_generation(self) -> None:
        self._step("continue", lambda: setattr(self, "paused", False))

    def close(self) -> None:
        pass

    def index(self, kind: str, step: str) -> int:
        return self.log.index((kind, step))


def _update(clock: Clock, **kwargs) -> tuple[EngineUpdate, RecordingClient]:
    client = RecordingClient(clock, **kwargs)
    update = EngineUpdate(client, clock=clock)  # type: ignore[arg-type]
    update.adopt()
    return update, client


def _one_update(update: EngineUpdate, version: str = "4", pause_mode: str = "abort") -> None:
    update.open(pause_mode, version)
    update.mark_written()
    update.writes_landed()
    update.close()
    update.finish(version)


# -- which calls overlap and which wait ---------------------------------------------------------


def test_the_updating_marker_and_the_flush_run_at_once():
    update, client = _update(Clock())
    client.meet = {"marker": "flush", "flush": "marker"}
    _one_update(update)
    assert client.met == {"marker": True, "flush": True}


def test_calls_that_depend_on_each_other_wait_for_the_answer():
    update, client = _update(Clock())
    _one_update(update)
    i = client.index
    # the marker only once paused: responses finished before the pause carry the old version
    assert i("end", "pause") < min(i("start", "marker"), i("start", "flush"))
    # begin only once the marker answered: an open engine always shows "updating"
    assert max(i("end", "marker"), i("end", "flush")) < i("start", "begin")
    # the new version only once end answered, resume only once the new version answered:
    # tokens generated with the new weights never carry the "updating" version
    assert i("end", "end") < i("start", "version") < i("end", "version") < i("start", "continue")
    assert [step for kind, step in client.log if kind == "start"].count("flush") == 1


def test_in_place_pause_runs_no_flush_and_no_pair():
    update, client = _update(Clock())
    _one_update(update, pause_mode="in_place")
    steps = [step for kind, step in client.log if kind == "start"]
    assert steps == ["pause", "marker", "begin", "end", "version", "continue"]


def test_the_weight_check_snapshot_and_reset_follow_the_marker():
    update, client = _update(Clock())
    update.open("abort", "4", snapshot=True)
    i = client.index
    assert i("end", "marker") < i("start", "snapshot") < i("start", "reset_tensors")
    assert i("end", "reset_tensors") < i("start", "begin")


# -- a failure inside the concurrent pair -------------------------------------------------------


@pytest.mark.parametrize("failing", ["marker", "flush"])
@pytest.mark.parametrize("how", ["refused", "silent", "lost"])
def test_a_failure_in_the_pair_leaves_the_engine_closed_and_resumable(failing, how):
    update, client = _update(Clock())
    if how == "refused":
        client.fail[failing] = EngineError(f"engine http://e0: /{failing} failed: refused")
    elif how == "silent":
        client.fail[failing] = EngineUnreachable(f"engine http://e0: /{failing}: no answer")
    else:
        client.lost.add(failing)
    with pytest.raises(EngineError, match=failing):
        update.open("abort", "4")
    other = "flush" if failing == "marker" else "marker"
    assert ("end", other) in client.log  # the other call of the pair ran to its answer
    assert ("start", "begin") not in client.log and not client.open
    assert update.shows_updating and not update.incomplete
    assert update.phase is (Phase.PAUSED if how == "refused" else Phase.UNKNOWN)
    outcome = update.abort()
    assert outcome == "resumed (weight version 3)"
    assert not client.paused and client.version == "3"


def test_both_calls_of_the_pair_failing_names_both():
    update, client = _update(Clock())
    client.fail["marker"] = EngineUnreachable("engine http://e0: /marker: no answer")
    client.fail["flush"] = EngineError("engine http://e0: /flush failed: busy")
    with pytest.raises(EngineError, match=r"marker.*flush|flush.*marker"):
        update.open("abort", "4")
    assert update.phase is Phase.UNKNOWN and not client.open
    _one_update(update, version="5")  # the retry converges
    assert client.version == "5" and not client.paused and not client.open


# -- paused seconds -----------------------------------------------------------------------------


def test_paused_seconds_run_from_the_pause_answer_to_the_resume_answer():
    clock = Clock()
    update, client = _update(clock)
    _one_update(update)
    # pause answered at 1; marker, flush, begin, end, version, continue: 6 more answers
    assert update.paused_s == 6.0
    assert client.log[-1] == ("end", "continue") and clock.now == 7.0


def test_an_engine_left_paused_by_a_failed_update_counts_from_the_retry_that_resumes_it():
    clock = Clock()
    update, client = _update(clock)
    client.fail["begin"] = EngineError("engine http://e0: /begin failed: refused")
    with pytest.raises(EngineError):
        update.open("abort", "4")
    assert update.pause_made is True
    clock.now = 100.0  # the retry comes much later
    _one_update(update)
    assert client.log.count(("start", "pause")) == 1  # not paused again
    assert update.pause_made is False  # this update found it paused
    assert update.paused_s == clock.now - 100.0  # from this update's start, not the first pause


def test_an_adopted_engine_in_an_unknown_state_counts_from_this_updates_pause():
    clock = Clock()
    clock.now = 10.0
    update, client = _update(clock, version=f"{UPDATING_PREFIX}3")
    assert update.paused_since == 10.0
    clock.now = 50.0  # connect, then the trainer's step
    _one_update(update)
    assert ("start", "pause") in client.log  # unknown state: paused again, tolerantly
    assert update.pause_made is True
    assert update.paused_s == clock.now - 51.0  # from the pause's answer


def test_an_adopted_engine_reported_paused_counts_from_this_updates_start():
    clock = Clock()
    client = RecordingClient(clock, version=f"{UPDATING_PREFIX}3")
    client.engine_state = lambda: {"paused": True, "update_open": False}  # type: ignore[method-assign]
    update = EngineUpdate(client, clock=clock)  # type: ignore[arg-type]
    update.adopt()
    clock.now = 50.0
    _one_update(update)
    assert ("start", "pause") not in client.log  # paused already: this update made no pause
    assert update.pause_made is False
    assert update.paused_s == clock.now - 50.0


def _fleet(clock: Clock, urls: list[str]) -> tuple[Fleet, list[RecordingClient]]:
    engines, clients = [], []
    for index, url in enumerate(urls):
        client = RecordingClient(clock, url=url)
        engine = ConnectedEngine(index, EngineEndpoint(url), client, {}, [])  # type: ignore[arg-type]
        engine.update = EngineUpdate(client, clock=clock)  # type: ignore[arg-type]
        engines.append(engine)
        clients.append(client)
    return Fleet(engines), clients


def _paused_seconds(fleet: Fleet) -> dict[str, float]:
    """What ``Fleet.engine_reports`` reads: each engine's last update's pause."""
    return {e.url: e.update.paused_s for e in fleet.engines if e.update.paused_s is not None}


def test_the_fleet_reports_the_last_updates_paused_seconds_per_engine():
    clock = Clock()
    fleet, clients = _fleet(clock, ["http://a"])
    assert _paused_seconds(fleet) == {}
    fleet.open("abort", "1", snapshot=False)
    assert clients[0].reachable_connections == [2]  # both connections of the pair warmed
    fleet.mark_written()
    fleet.writes_sent(lambda url: True)
    fleet.close()
    assert fleet.writes_verified() == ["http://a"]
    fleet.finish("1")
    assert _paused_seconds(fleet) == {"http://a": 6.0}
    clients[0].fail["reachable"] = EngineUnreachable("engine http://a: no answer")
    with pytest.raises(EngineUnreachable):
        fleet.open("abort", "2", snapshot=False)
    assert _paused_seconds(fleet) == {}  # that update paused nothing


def test_report_carries_paused_seconds_and_control_calls():
    report = UpdateReport(version="1", bytes_by_target={})
    assert report.paused_s == {} and report.num_control_calls == 0
    report = UpdateReport(
        version="1",
        bytes_by_target={("http://a", 0): 10},
        seconds=1.0,
        engines={
            url: EngineReport(url, "mooncake", "tcp", 1, 10, paused_s=s, pause_made=True)
            for url, s in {"http://a": 0.25, "http://b": 0.5}.items()
        },
        num_control_calls=9,
        control_call_seconds=0.125,
    )
    assert report.paused_s == {"http://a": 0.25, "http://b": 0.5}
    assert "paused up to 0.500 s (http://b)" in report.summary()
    assert "9 control calls 0.125 s" in report.summary()


# -- counting the calls -------------------------------------------------------------------------


def _call(route: str, started: float, ended: float, url: str = "http://a", new: bool = False):
    return ControlCall(url, route, started, ended, new_connection=new)


def test_control_calls_count_and_wall_time_of_overlapping_calls():
    calls = ControlCalls(
        (
            _call("POST /pause_generation", 0.0, 2.0, new=True),
            _call("POST /update_weight_version", 1.0, 3.0),
            _call("GET /flush_cache", 5.0, 6.0, url="http://b"),
            _call("POST /update_weight_version", 7.0, 7.5),
        )
    )
    assert calls.num_calls == 4
    assert calls.call_seconds == 5.5
    assert calls.wall_seconds == 4.5  # [0, 3] + [5, 6] + [7, 7.5]
    assert calls.num_new_connections == 1
    assert calls.by_route()[("http://a", "POST /update_weight_version")] == (2, 2.5)


def test_a_call_log_keeps_the_most_recent_calls_only():
    log = CallLog(max_calls=3)
    for i in range(5):
        log.record(_call(f"GET /{i}", float(i), float(i) + 1))
    assert [c.route for c in log.calls()] == ["GET /2", "GET /3", "GET /4"]
    log.clear()
    assert log.calls() == []


def test_the_fleet_counts_the_calls_of_the_last_update():
    clock = Clock()
    fleet, clients = _fleet(clock, ["http://a", "http://b"])
    for client in clients:
        client.calls.record(_call("GET /server_info", 0.0, 1.0, url=client.url))  # connect's
    fleet.open("abort", "1", snapshot=False)
    for client in clients:
        client.calls.record(_call("POST /pause_generation", 2.0, 3.0, url=client.url))
    calls = fleet.control_calls()
    assert calls.num_calls == 2  # connect's calls are not the update's
    assert {c.url for c in calls.calls} == {"http://a", "http://b"}


# -- pause_mode "caller": the caller pauses and resumes ----------------------------------------


class ReportingClient(RecordingClient):
    """An engine that reports its state, as the p2pweights local engine does."""

    def engine_state(self) -> dict[str, bool] | None:
        return {"paused": self.paused, "update_open": self.open}


def test_caller_mode_neither_pauses_nor_resumes_but_runs_every_step_between():
    clock = Clock()
    client = ReportingClient(clock)
    update = EngineUpdate(client, clock=clock)  # type: ignore[arg-type]
    update.adopt()
    client.paused = True  # the caller paused it (verl: pause_generation mode "abort")
    for version in ("4", "5"):
        client.log.clear()
        _one_update(update, version=version, pause_mode="caller")
        steps = [step for kind, step in client.log if kind == "start"]
        assert sorted(steps[:2]) == ["flush", "marker"]
        assert steps[2:] == ["begin", "end", "version"]
        assert client.version == version and client.paused and not client.open
    assert update.paused_s is None and not update.paused_by_us


def test_caller_mode_refuses_a_generating_engine_before_any_engine_is_marked_or_flushed():
    clock = Clock()
    fleet, _ = _fleet(clock, ["http://a", "http://b"])
    clients = []
    for engine, generating in zip(fleet.engines, (False, True), strict=True):
        client = ReportingClient(clock, url=engine.url)
        client.paused = not generating  # the caller paused http://a only
        engine.client = client  # type: ignore[assignment]
        engine.update = EngineUpdate(client, clock=clock)  # type: ignore[arg-type]
        engine.update.adopt()
        clients.append(client)
    with pytest.raises(EngineStateError, match="http://b is generating: pause_mode='caller'"):
        fleet.open("caller", "4", snapshot=False)
    for client in clients:  # the paused one too: neither marked, flushed nor begun
        assert [step for _, step in client.log] == ["reachable", "reachable"]
        assert client.version == "3" and not client.open


def test_caller_mode_abort_closes_the_engine_and_leaves_it_to_the_caller():
    update, client = _update(Clock())  # reports no state, as released sglang: trusted
    client.paused = True
    update.open("caller", "4")
    outcome = update.abort()
    assert outcome.startswith("left as the caller paused it")
    assert not client.open and client.version == "3" and client.paused
    report = AbortReport(outcomes={client.url: outcome})
    assert report.ok


@pytest.mark.parametrize("failed_check", [False, True])
def test_caller_mode_abort_of_a_torn_engine_says_not_to_resume_it(failed_check):
    update, client = _update(Clock())
    client.paused = True
    update.open("caller", "4")
    update.mark_written()
    if failed_check:
        update.writes_landed()
        update.writes_wrong()
    outcome = update.abort()
    assert outcome.startswith("left paused by the caller")
    assert "must not be resumed" in outcome
    assert ("weights may be wrong" if failed_check else "weights may be torn") in outcome
    assert not client.open and client.version == "p2pweights-updating:4" and client.paused
    report = AbortReport(outcomes={client.url: outcome})
    assert not report.ok and report.left_paused == [client.url]
    with pytest.raises(EngineStateError, match="must not be resumed"):
        report.raise_if_not_ok()


def _published(agent: str, epoch: int, live: bool, address: int = 4096):
    from p2pweights.wire.publication import RankPublication, WeightRegion

    return RankPublication(
        "http://a",
        0,
        "nixl",
        {"w": WeightRegion(address, 64)},
        agent_name=agent,
        live=live,
        epoch=epoch,
    )


@pytest.mark.parametrize(
    ("connected", "now", "restarted"),
    [
        (_published("a1", 0, True), _published("a2", 2, True, 8192), False),  # moved twice
        (_published("a1", 0, True), _published("a1", 0, True), False),
        (_published("a1", 1, True), _published("b1", 0, True), True),  # epochs start again
        (_published("a1", 0, True), _published("b1", 0, True), True),  # a new process
        (_published("a1", 0, False), _published("a1", 0, False, 8192), True),
        (_published("a1", 0, False), _published("b1", 0, False), True),
        (_published("a1", 0, False), _published("a1", 0, False), False),
    ],
)
def test_an_engine_restarted_since_connect_is_told_from_one_that_republished(
    connected, now, restarted
):
    """Issue 39 item 8: asked before any engine is paused. A live publication the same
    process republished (its weights moved) has a new peer and a later epoch."""

    class Client:
        url = "http://a"

        def publication(self, rank, role="target"):
            return now

    engine = ConnectedEngine(0, EngineEndpoint("http://a"), Client(), {}, [connected])  # type: ignore[arg-type]
    if restarted:
        with pytest.raises(EngineError, match=r"restarted since connect\(\).*connect\(\) again"):
            engine.check_not_restarted()
    else:
        engine.check_not_restarted()
