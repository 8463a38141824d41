"""The session's sequencing against fake engines that enforce sglang's update rules.

``FakeEngine`` keeps what a real sglang server keeps (paused or not, an update session
open or not, the weight version, the weight bytes) and refuses what sglang refuses:
``begin_weight_update`` while a session is open, ``end_weight_update`` without one.
A write into an engine with no open session is recorded as a violation. Failures are
injected at every step in three ways: an answered refusal (nothing happened), no
answer before anything happened, and an answer lost after the step took effect.

The replicas and the transport are stand-ins too (unit level only); real engines,
sglang model code and real transports are exercised in tests/integration.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from p2pweights import ConfigError, SyncConfig, TrainerTopology, TransferError, WeightSyncSession
from p2pweights import sync_connection as connection_module
from p2pweights import update_attempt as update_attempt_module
from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.calls import CallLog
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import EngineError, EngineUnreachable, LayoutMismatchError, P2PWeightsError
from p2pweights.plan import prepare as prepare_module
from p2pweights.source.checkpoint_format import AS_GIVEN
from p2pweights.source.inputs import ParamGroup
from p2pweights.transports.base import Transport
from p2pweights.wire.publication import RankPublication, WeightRegion

PARAMS = {"qkv": 600 * 1024, "o": 600 * 1024}  # two groups: two flushes of a 1 MiB buffer
GROUPS = [ParamGroup(frozenset({"q", "k", "v"}), ("qkv",)), ParamGroup(frozenset({"o"}), ("o",))]

# -- a fake sglang engine ----------------------------------------------------------------------


@dataclass
class FakeEngine:
    url: str
    reports_state: bool = True  # the p2pweights local engine does; released sglang does not
    paused: bool = False
    open: bool = False
    version: str = "default"
    memory: dict[str, torch.Tensor] = field(
        default_factory=lambda: {n: torch.zeros(s, dtype=torch.uint8) for n, s in PARAMS.items()}
    )
    events: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    inject: dict[str, str] = field(default_factory=dict)
    """step -> "answered" | "silent" | "lost"; one-shot."""
    dead: bool = False
    snapshot: dict[str, torch.Tensor] | None = None
    writes: int = 0
    moves_storage: bool = False
    """end_weight_update gives every weight new storage (as sglang's CPU AMX packing does);
    its publication is live and the epoch counts how often it was published afresh."""
    grows: str | None = None
    """A weight end_weight_update gives new storage of another size."""
    epoch: int = 0
    freed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Storage given up, with a copy of what it held then: nothing may write it later."""

    def call(self, step: str, effect) -> object:
        if self.dead:
            raise EngineUnreachable(f"engine {self.url}: {step}: connection refused")
        kind = self.inject.pop(step, None)
        if kind == "answered":
            raise EngineError(f"engine {self.url}: /{step} failed: injected refusal")
        if kind == "silent":
            raise EngineUnreachable(f"engine {self.url}: /{step} got no answer (injected)")
        result = effect()
        self.events.append(step)
        if kind == "lost":
            raise EngineUnreachable(f"engine {self.url}: /{step} answer lost (injected)")
        return result

    def begin(self) -> None:
        if self.open:
            raise EngineError(
                f"engine {self.url}: /begin_weight_update failed: a weight-update session is "
                "already open; call end_weight_update() first"
            )
        self.open = True

    def end(self) -> None:
        if not self.open:
            raise EngineError(
                f"engine {self.url}: /end_weight_update failed: no weight-update session is "
                "open; call begin_weight_update() first"
            )
        self.open = False
        if self.moves_storage or self.grows:
            for name, old in list(self.memory.items()):
                self.freed.append((old, old.clone()))
                size = old.numel() * (2 if name == self.grows else 1)
                self.memory[name] = torch.cat([old, old])[:size].clone()
            self.epoch += 1

    def check(self, action: str) -> dict:
        """sglang's weight checker: snapshot, reset_tensors (noise in every weight), compare."""
        if action == "snapshot":
            self.snapshot = {n: t.clone() for n, t in self.memory.items()}
        elif action == "reset_tensors":
            for tensor in self.memory.values():
                tensor.fill_(0xAB)
        elif action == "compare":
            assert self.snapshot is not None, "compare without a snapshot"
            if any(not torch.equal(self.memory[n], s) for n, s in self.snapshot.items()):
                raise EngineError(f"engine {self.url}: /weights_checker failed: mismatch")
        return {"success": True}

    def set(self, **state) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    @property
    def running(self) -> bool:
        return not self.paused and not self.open


class FakeClient:
    """The EngineClient methods connect and the update session call, on a FakeEngine."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.url = engine.url
        self.calls = CallLog()

    def server_info(self):
        return {"tp_size": 1, "version": "0.5.23"}

    def publication(self, rank, role="target"):
        regions = {n: WeightRegion(t.data_ptr(), t.numel()) for n, t in self.engine.memory.items()}
        live = self.engine.moves_storage or self.engine.grows is not None
        return RankPublication(
            self.url, rank, "mooncake", regions, session_id="s", live=live, epoch=self.engine.epoch
        )

    def weight_version(self):
        return self.engine.call("model_info", lambda: self.engine.version)

    def check_reachable(self, connections=1):
        if self.engine.dead:
            raise EngineUnreachable(f"engine {self.url}: GET /model_info: connection refused")

    def engine_state(self):
        state = {"paused": self.engine.paused, "update_open": self.engine.open}
        reported = self.engine.call("server_info", lambda: state)
        return reported if self.engine.reports_state else None

    def pause_generation(self, mode):
        self.engine.call("pause", lambda: self.engine.set(paused=True))

    def flush_cache(self):
        self.engine.call("flush", lambda: None)

    def begin_weight_update(self, selector="all"):
        self.engine.call("begin", self.engine.begin)

    def end_weight_update(self):
        self.engine.call("end", self.engine.end)
        return {}  # sglang's answer carries no write-digest records

    def update_weight_version(self, version):
        step = "version_marker" if version.startswith(UPDATING_PREFIX) else "version"
        self.engine.call(step, lambda: self.engine.set(version=version))

    def weights_checker(self, action, **options):
        return self.engine.call(action, lambda: self.engine.check(action))

    def continue_generation(self):
        self.engine.call("continue", lambda: self.engine.set(paused=False))

    def close(self):
        pass


# -- stand-ins for the replica and the transport ---------------------------------------------


class FakeHandle:
    key = "layout"
    spec = "tp1"
    config_path = Path("/nonexistent/config.json")
    layouts = dict(PARAMS)

    def check_published(self, pub):
        for name, size in PARAMS.items():
            if pub.regions[name].num_bytes != size:
                raise LayoutMismatchError(
                    f"{pub.where} parameter {name!r}: engine published "
                    f"{pub.regions[name].num_bytes} bytes, the replica lays out {size}"
                )

    def checkpoint_format(self, specs):
        return AS_GIVEN

    def groups(self, specs):
        return GROUPS

    def param_bytes(self, name):
        return PARAMS[name]

    def load_into(self, inputs, views):
        # every parameter gets the first input's value (its bytes encode the update)
        for view in views.values():
            view.fill_(int(inputs[0][1][0]))


class FakeTransport(Transport):
    name = "fake"

    def __init__(self, engines: dict[str, FakeEngine]):
        self.engines = engines

    def register(self, buffer):
        pass

    def unregister(self, buffer):
        pass

    def connect(self, pub):
        pass

    def disconnect(self, pub):
        pass

    def write(self, target, writes, timeout_s):
        engine = self.engines[target.engine_url]
        if engine.dead:
            raise TransferError(f"engine {target.engine_url} rank 0: peer gone")
        if not engine.open:
            engine.violations.append("write outside an open update session")
        engine.writes += 1
        if engine.inject.pop(f"write{engine.writes}", None):
            raise TransferError(f"engine {target.engine_url} rank 0: injected write failure")
        for w in writes:
            ctypes.memmove(w.dst_address, w.src_address, w.num_bytes)
        engine.events.append(f"write x{len(writes)}")

    def close(self):
        pass


@pytest.fixture
def engines(monkeypatch) -> dict[str, FakeEngine]:
    engines: dict[str, FakeEngine] = {}

    def client_for(url, **kwargs):
        return FakeClient(engines.setdefault(url, FakeEngine(url)))

    monkeypatch.setattr(fleet_module, "EngineClient", client_for)
    monkeypatch.setattr(connection_module, "replica_for", lambda *a: FakeHandle())
    monkeypatch.setattr(
        connection_module, "create_transport", lambda config: FakeTransport(engines)
    )
    monkeypatch.setattr(
        update_attempt_module, "check_against_checkpoints", lambda specs, expected: None
    )
    monkeypatch.setattr(prepare_module, "config_path", lambda info, path: Path("/x/config.json"))
    monkeypatch.setattr(prepare_module, "expected_checkpoint", lambda folder: None)
    monkeypatch.setattr(fleet_module, "check_sglang_version", lambda *a: None)
    return engines


def _tensors(value: int):
    return [(n, torch.full((2,), value, dtype=torch.uint8)) for n in ("q", "k", "v", "o")]


def _holds(engine: FakeEngine, value: int) -> bool:
    return all(bool((t == value).all()) for t in engine.memory.values())


def _control(events):
    return [e for e in events if not e.startswith("write")]


CONFIG = SyncConfig(buffer_bytes="1MiB")


def test_update_session_order(engines):
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0/"])
        report = session.update(_tensors(7))
    engine = engines["http://e0"]
    control = [e for e in _control(engine.events) if e not in ("model_info", "server_info")]
    assert control[0] == "pause" and set(control[1:3]) == {"version_marker", "flush"}
    assert control[3:] == ["begin", "end", "version", "continue"]
    assert report.bytes_by_target == {("http://e0", 0): sum(PARAMS.values())}
    assert _holds(engine, 7) and engine.running and engine.version == "1"
    assert engine.violations == []


def test_check_snapshots_once_and_compares_once(engines):
    config = SyncConfig(buffer_bytes="1MiB", verify_with_weight_checker=True, pause_mode="in_place")
    with WeightSyncSession(config) as session:
        session.connect(["http://e0"])
        session.update(_tensors(0))  # the engine's start weights: the check passes
        session.update(_tensors(2))
    events = engines["http://e0"].events
    assert events.count("snapshot") == 1 and events.count("compare") == 1
    assert "flush" not in events  # in_place keeps requests; sglang cannot flush then
    assert events.index("reset_tensors") < events.index("begin")


# the marker and the flush run at once (either may answer first), before the snapshot
STEPS = ["pause", "version_marker", "flush", "snapshot", "reset_tensors", "begin", "write1"]
STEPS += ["write2", "end", "compare", "version", "continue"]
KINDS = ["answered", "silent", "lost"]
WRITES = ("write1", "write2")  # the first and the second flush's batch


def _cases():
    for step in STEPS:
        for kind in KINDS if step not in WRITES else ["failed"]:
            for reports_state in (True, False):
                yield pytest.param(
                    step,
                    kind,
                    reports_state,
                    id=f"{step}-{kind}-{'state' if reports_state else 'sglang'}",
                )


def _fail_once(engines, url, step, kind, reports_state):
    engine = engines.setdefault(url, FakeEngine(url, reports_state=reports_state))
    engine.inject[step] = kind
    return engine


@pytest.mark.parametrize(("step", "kind", "reports_state"), list(_cases()))
@pytest.mark.parametrize("num_engines", [1, 2])
def test_failure_at_any_step_then_retry_converges(engines, step, kind, reports_state, num_engines):
    """The first update sends the engines' start weights (zeros), as the weight check needs;
    reset_tensors fills every weight with noise, so holding zeros proves the rewrite."""
    config = SyncConfig(buffer_bytes="1MiB", verify_with_weight_checker=True)
    engine = _fail_once(engines, "http://e0", step, kind, reports_state)
    urls = ["http://e0", "http://e1"][:num_engines]
    with WeightSyncSession(config) as session:
        session.connect(urls)
        with pytest.raises(P2PWeightsError):
            session.update(_tensors(0))
        report = session.update(_tensors(0))
        session.update(_tensors(4))
    for url in urls:
        assert _holds(engines[url], 4), "the retry rewrote every weight"
        assert engines[url].running and engines[url].version == str(int(report.version) + 1)
        assert engines[url].violations == []
        # a snapshot whose answer was lost is taken again: harmless, nothing was reset yet
        snapshots = 2 if (url, step, kind) == ("http://e0", "snapshot", "lost") else 1
        assert engines[url].events.count("snapshot") == snapshots
    resets = 2 if (step, kind) == ("reset_tensors", "lost") else 1  # lost: asked again
    assert engine.events.count("reset_tensors") == resets


@pytest.mark.parametrize(("step", "kind", "reports_state"), list(_cases()))
@pytest.mark.parametrize("give_up", ["abort", "close"])
def test_failure_at_any_step_then_giving_up_leaves_engines_running(
    engines, step, kind, reports_state, give_up
):
    config = SyncConfig(buffer_bytes="1MiB", verify_with_weight_checker=True)
    engine = _fail_once(engines, "http://e0", step, kind, reports_state)
    session = WeightSyncSession(config)
    session.connect(["http://e0"])
    with pytest.raises(P2PWeightsError):
        session.update(_tensors(0))
    report = session.abort() if give_up == "abort" else session.close()
    assert not engine.open and engine.violations == []
    # torn (reset to noise, writes that did not all land, or landed but whose end never
    # answered, so never verified): never resumed on our own
    torn = STEPS.index("reset_tensors") <= STEPS.index(step) <= STEPS.index("end")
    torn = torn and not (step == "reset_tensors" and kind == "answered")
    # a weight check that failed or went unanswered: torn until an update's check passes
    check_failed = step == "compare"
    if torn or check_failed:
        assert engine.paused and engine.version == f"{UPDATING_PREFIX}1"
        if report is not None:
            why = "weight check failed" if check_failed else "did not all land"
            why = "not verified" if step == "end" else why
            assert not report.ok and why in report.outcomes["http://e0"]
            session.abort(resume_incomplete=True)
            assert engine.running
    else:
        assert engine.running
        # whole weights show their version: the old one if no byte was written
        written = STEPS.index(step) > STEPS.index("write2")
        assert engine.version == ("1" if written else "default")
        if report is not None:
            assert report.ok, str(report)
    session.close()


def test_one_engine_failing_its_writes_does_not_tear_the_others(engines):
    torn = _fail_once(engines, "http://bad", "write2", "failed", True)
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://bad", "http://good"])
        with pytest.raises(TransferError, match="http://bad rank 0"):
            session.update(_tensors(5))
        good = engines["http://good"]
        # every byte landed: ended and verified within the failed update, it waits paused
        assert _holds(good, 5) and good.paused and not good.open
        report = session.abort()
    assert good.running and good.violations == []
    assert torn.paused and torn.version.startswith(UPDATING_PREFIX)
    assert report.outcomes["http://good"] == "resumed (weight version 1)"
    assert good.version == "1"  # whole: it shows the version its weights are
    assert report.left_paused == ["http://bad"]


def test_an_engine_that_moves_its_weights_is_written_where_they_live_now(engines):
    """sglang's CPU AMX packing replaces every linear weight's storage after each load: the
    addresses published at start-up are freed memory from the second update on."""
    moving = engines.setdefault("http://m", FakeEngine("http://m", moves_storage=True))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://m", "http://still"])
        for value in (1, 2, 3):
            session.update(_tensors(value))
            assert _holds(moving, value) and _holds(engines["http://still"], value)
    assert moving.epoch == 3 and moving.violations == []
    assert len(moving.freed) == 6
    assert all(torch.equal(old, then) for old, then in moving.freed), "wrote into freed storage"


def test_weights_republished_in_another_size_are_refused_before_any_write(engines):
    grown = engines.setdefault("http://g", FakeEngine("http://g", grows="qkv"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://g"])
        session.update(_tensors(1))
        writes = grown.writes
        with pytest.raises(LayoutMismatchError) as failed:
            session.update(_tensors(2))
        message = str(failed.value)
        assert "http://g rank 0" in message and "'qkv'" in message
        assert "published its weights afresh (epoch 0 -> 1" in message
        assert grown.writes == writes  # not a byte written
        report = session.abort()
    assert grown.running and grown.version == "1"  # its weights are the first update's, whole
    assert report.ok


def test_with_other_senders_a_failed_refresh_on_the_leader_leaves_the_engines_torn(engines):
    """Other trainer ranks write once the open step passed, even when the leader's own
    refresh then fails: the engines must count as torn, so abort() does not resume them."""
    grown = engines.setdefault("http://g", FakeEngine("http://g", grows="qkv"))
    other = engines.setdefault("http://h", FakeEngine("http://h", grows="qkv"))
    config = SyncConfig(buffer_bytes="1MiB")
    two = TrainerTopology(rank=0, num_ranks=2)
    with WeightSyncSession(config, topology=two, agree=lambda ok: ok) as session:
        session.connect(["http://g", "http://h"])
        session.update(_tensors(1))
        with pytest.raises(LayoutMismatchError):
            session.update(_tensors(2))
        report = session.abort()
    assert sorted(report.left_paused) == ["http://g", "http://h"]
    assert grown.paused and other.paused and grown.version == f"{UPDATING_PREFIX}2"


def test_an_engine_dead_since_the_last_update_fails_the_next_before_any_engine_pauses(engines):
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://a", "http://b"])
        session.update(_tensors(1))
        engines["http://b"].dead = True
        before = list(engines["http://a"].events)
        with pytest.raises(EngineUnreachable, match="http://b"):
            session.update(_tensors(2))
        assert engines["http://a"].events == before  # not paused, not touched
        assert engines["http://a"].running and engines["http://a"].version == "1"
        with pytest.raises(EngineUnreachable, match="http://b"):  # nor by a retry
            session.update(_tensors(2))
        assert engines["http://a"].events == before


def test_abort_from_another_thread_cancels_a_running_update(engines):
    import threading

    first_sent, release = threading.Event(), threading.Event()

    def streamed(value):
        # "o" did not fit beside q, k, v: the engine opened and q, k, v were written;
        # the trainer is slow to end its input ("o" staged, not written)
        yield from _tensors(value)
        first_sent.set()
        release.wait(10)

    outcome: dict[str, object] = {}
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))

        def run():
            try:
                outcome["report"] = session.update(streamed(2))
            except Exception as exc:
                outcome["error"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        assert first_sent.wait(10)
        aborter = threading.Thread(target=lambda: outcome.setdefault("abort", session.abort()))
        aborter.start()
        for _ in range(1000):  # abort() asked the update to stop before the trainer goes on
            if session._cancel.is_set():
                break
            threading.Event().wait(0.01)
        release.set()
        worker.join(10)
        aborter.join(10)
        assert not worker.is_alive() and not aborter.is_alive()
        assert isinstance(outcome.get("error"), TransferError), outcome
        assert "cancelled by abort()" in str(outcome["error"])
        report = outcome["abort"]
        engine = engines["http://e0"]
        assert report.left_paused == ["http://e0"]  # part of update 2 was written: torn
        assert engine.paused and engine.version == f"{UPDATING_PREFIX}2"
        session.update(_tensors(3))  # and the session goes on
    assert engine.running and _holds(engine, 3)


def test_abort_before_the_first_buffer_was_written_leaves_the_engine_untouched(engines):
    """The engines pause only once the first staging buffer is loaded: an update
    cancelled while it is staged never paused them."""
    import threading

    staging, release = threading.Event(), threading.Event()

    def streamed(value):
        for i, pair in enumerate(_tensors(value)):
            if i == 3:  # q, k, v staged; the trainer is slow on "o"
                staging.set()
                release.wait(10)
            yield pair

    outcome: dict[str, object] = {}
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
        engine = engines["http://e0"]
        before = list(engine.events)

        def run():
            try:
                session.update(streamed(2))
            except Exception as exc:
                outcome["error"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        assert staging.wait(10)
        aborter = threading.Thread(target=lambda: outcome.setdefault("abort", session.abort()))
        aborter.start()
        for _ in range(1000):
            if session._cancel.is_set():
                break
            threading.Event().wait(0.01)
        release.set()
        worker.join(10)
        aborter.join(10)
        assert isinstance(outcome.get("error"), TransferError), outcome
        assert outcome["abort"].ok  # type: ignore[attr-defined]
        assert engine.events == before  # never paused, opened or written
        assert engine.running and _holds(engine, 1) and engine.version == "1"


@pytest.mark.parametrize("stage_before_pause", [True, False])
def test_engines_pause_only_once_the_first_buffer_is_loaded(
    engines, monkeypatch, stage_before_pause
):
    """Prepare before pause: reading, checking and staging the first buffer happen while
    the engine still generates; it pauses right before the first write (unless
    ``stage_before_pause=False``)."""
    order: list[str] = []
    loaded = FakeHandle.load_into

    def load_into(self, inputs, views):
        order.append(f"load {len(views)} (engine paused: {engines['http://e0'].paused})")
        loaded(self, inputs, views)

    monkeypatch.setattr(FakeHandle, "load_into", load_into)
    config = SyncConfig(buffer_bytes="1MiB", stage_before_pause=stage_before_pause)
    with WeightSyncSession(config) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
        order.clear()
        session.update(iter(_tensors(2)))
    first = f"load 1 (engine paused: {not stage_before_pause})"
    assert order == [first, "load 1 (engine paused: True)"]
    assert _holds(engines["http://e0"], 2) and engines["http://e0"].violations == []


class Described:
    """An iterator that says what it will yield (``specs()``), as hf_named_tensors does."""

    def __init__(self, value, engine, session):
        self.pairs, self.engine, self.session = iter(_tensors(value)), engine, session
        self.planned_at_first_pull: bool | None = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.planned_at_first_pull is None:
            self.planned_at_first_pull = self.session._connection.prepared is not None
        return next(self.pairs)

    def specs(self):
        return {name: (tuple(t.shape), t.dtype) for name, t in _tensors(0)}


def test_a_first_update_from_a_described_iterator_is_planned_before_it_is_read(engines):
    """Planning needs names, shapes and dtypes only: the input is then streamed, not held."""
    engine = engines.setdefault("http://e0", FakeEngine("http://e0"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        described = Described(4, engine, session)
        session.update(described)
        assert described.planned_at_first_pull is True  # planned before it was read
        assert _holds(engine, 4)
    with WeightSyncSession(CONFIG) as session:  # a first update again
        session.connect(["http://e0"])
        plain = Described(5, engine, session)
        plain.specs = None  # says nothing: the first update reads it whole to plan it
        session.update(plain)
        assert plain.planned_at_first_pull is False
    assert _holds(engine, 5) and engine.violations == []


def test_a_described_iterator_that_does_not_yield_what_it_said_fails_the_update(engines):
    engine = engines.setdefault("http://e0", FakeEngine("http://e0"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        liar = Described(4, engine, session)
        liar.pairs = iter([(n, t.to(torch.float32)) for n, t in _tensors(4)])
        with pytest.raises(ConfigError, match=r"'q' is torch\.float32, the first update sent"):
            session.update(liar)


def test_a_rank_that_fails_early_still_reads_a_stream_to_its_end_with_other_senders(engines):
    """A stream may run collectives as it is read (FSDP2 gathers bucket by bucket): a
    trainer rank whose write step fails before it read the stream (here: cancelled by
    abort()) must still read it whole, or the other ranks hang in those collectives."""
    config = SyncConfig(buffer_bytes="1MiB")
    two = TrainerTopology(rank=0, num_ranks=2)
    with WeightSyncSession(config, topology=two, agree=lambda ok: ok) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
        read = []

        def streamed():
            for pair in _tensors(2):
                read.append(pair[0])
                yield pair

        session._cancel.set()  # as abort() from another thread does
        with pytest.raises(TransferError, match="cancelled"):
            session._attempt("2")._write(streamed(), False, False)
        session._cancel.clear()
        assert read == ["q", "k", "v", "o"]  # drained, written nowhere
        assert engines["http://e0"].writes == 2  # the first update's two batches only


def test_a_failed_weight_check_leaves_the_engine_torn_until_an_update_passes_it(engines):
    config = SyncConfig(buffer_bytes="1MiB", verify_with_weight_checker=True)
    engine = engines.setdefault("http://c", FakeEngine("http://c"))
    with WeightSyncSession(config) as session:
        session.connect(["http://c"])
        with pytest.raises(EngineError, match="mismatch"):
            session.update(_tensors(7))  # not the engine's start weights: the check fails
        report = session.abort()
        assert report.left_paused == ["http://c"]
        assert "weight check failed" in report.outcomes["http://c"]
        assert engine.paused and engine.version == f"{UPDATING_PREFIX}1"
        session.update(_tensors(0))  # the retry compares again, and passes
        assert engine.events.count("compare") == 1  # (events record the calls that passed)
        assert engine.running and engine.version == "1"
        session.update(_tensors(3))  # checked once it passed
        assert engine.events.count("compare") == 1
    assert engine.running and _holds(engine, 3) and engine.violations == []


def test_a_dead_engine_is_reported_by_abort_and_the_others_resume(engines):
    steps = []

    def agree(ok):  # called after each step; engine b dies once the update session is open
        steps.append(ok)
        if len(steps) == 7:  # prepare, open, write, close, finish of update 1; prepare, open
            engines["http://b"].dead = True
        return ok

    with WeightSyncSession(CONFIG, agree=agree) as session:
        session.connect(["http://a", "http://b"])
        session.update(_tensors(1))
        with pytest.raises(P2PWeightsError, match="http://b"):
            session.update(_tensors(2))
        report = session.abort()
    assert engines["http://a"].running and _holds(engines["http://a"], 2)
    assert report.outcomes["http://b"].startswith("unreachable")
    assert report.left_paused == ["http://b"]


def test_a_new_session_adopts_an_engine_left_mid_update_and_rewrites_it(engines):
    engine = _fail_once(engines, "http://e0", "write1", "failed", False)
    first = WeightSyncSession(CONFIG)
    first.connect(["http://e0"])
    with pytest.raises(TransferError):
        first.update(_tensors(1))
    # the trainer dies here: no abort, no close; the engine stays open and paused
    assert engine.open and engine.paused and engine.version == f"{UPDATING_PREFIX}1"
    with WeightSyncSession(CONFIG) as second:
        second.connect(["http://e0"])
        report = second.update(_tensors(2))
    assert _holds(engine, 2) and engine.running and engine.version == report.version
    assert engine.violations == []


def test_versions_continue_from_the_engine_and_never_go_back(engines):
    engines["http://e0"] = FakeEngine("http://e0", version="41")
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        assert session.update(_tensors(1)).version == "42"
        assert session.update(_tensors(1), version="7").version == "7"
        assert session.update(_tensors(1)).version == "43"
        assert session.update(_tensors(1), version="step-9").version == "step-9"
        assert session.update(_tensors(1)).version == "44"


def test_other_rank_failure_fails_this_rank(engines):
    # every rank was given a list, prepare and open agreed; another rank's write failed
    votes = iter([True, True, True, False])
    config = SyncConfig(buffer_bytes="1MiB")
    second = TrainerTopology(rank=1, num_ranks=2)
    with WeightSyncSession(config, topology=second, agree=lambda ok: ok and next(votes)) as session:
        session.connect(["http://e0"])
        with pytest.raises(TransferError, match="another trainer rank failed the 'write' step"):
            session.update(_tensors(1))
    control = [e for e in engines["http://e0"].events if e not in ("model_info", "server_info")]
    assert control == []  # only trainer rank 0 drives the engines


def test_usage_errors(engines):
    with pytest.raises(ConfigError, match="agree="):
        WeightSyncSession(SyncConfig(), topology=TrainerTopology(num_ranks=2))
    session = WeightSyncSession(CONFIG)
    with pytest.raises(ConfigError, match="connect"):
        session.update(_tensors(1))
    with pytest.raises(ConfigError, match="once"):
        session.connect(["http://e0", EngineEndpoint("http://e0/")])
    with pytest.raises(ConfigError, match="buffer_bytes"):
        SyncConfig(buffer_bytes="lots")
    session.close()


def test_a_bad_tensor_in_a_streamed_update_leaves_a_visible_torn_engine(engines):
    def stream():
        yield from _tensors(6)  # "o" did not fit beside q, k, v: those were written
        yield "o", torch.zeros(3, dtype=torch.uint8)  # again, and of the wrong shape

    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB")) as session:
        session.connect(["http://e0"])
        session.update(_tensors(5))
        with pytest.raises(ConfigError, match="'o' has shape") as caught:
            session.update(stream())
        engine = engines["http://e0"]
        assert engine.paused and engine.version == f"{UPDATING_PREFIX}2"
        # the error says what the engines were left in, and what repairs them
        assert f"stay paused, with torn weights and the weight version '{UPDATING_PREFIX}2'" in (
            str(caught.value)
        )
        assert "the next update() rewrites them whole" in str(caught.value)
        report = session.update(iter(_tensors(7)))
    assert _holds(engine, 7) and engine.running and engine.version == report.version


def test_a_bad_tensor_before_the_first_buffer_was_written_leaves_the_engine_untouched(engines):
    def stream():
        yield from _tensors(6)[:3]  # q, k, v: the qkv group is complete and staged
        yield "o", torch.zeros(3, dtype=torch.uint8)  # the wrong shape

    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB")) as session:
        session.connect(["http://e0"])
        session.update(_tensors(5))
        engine = engines["http://e0"]
        before = list(engine.events)
        with pytest.raises(ConfigError, match="'o' has shape") as caught:
            session.update(stream())
        assert engine.events == before and engine.running and engine.version == "1"
        assert "No engine was paused or written" in str(caught.value)
        session.update(iter(_tensors(7)))
    assert _holds(engine, 7) and engine.running


def test_an_engine_left_open_without_a_marker_is_taken_over_and_rewritten(engines):
    """A trainer died between begin and marking the version: released sglang shows nothing,
    the next session's begin is refused as "already open", and it takes the session over."""
    engine = engines["http://e0"] = FakeEngine("http://e0", reports_state=False)
    engine.paused = engine.open = True
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        report = session.update(_tensors(3))
    assert _holds(engine, 3) and engine.running and engine.version == report.version


def test_a_reconnect_keeps_what_it_knew_and_abort_still_reaches_dropped_engines(engines):
    """After a failed update, connect() again: an engine still listed keeps its state (paused
    by us, torn), one no longer listed is still resumed by abort()."""
    torn = _fail_once(engines, "http://a", "write1", "failed", False)
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://a", "http://b"])
        with pytest.raises(TransferError):
            session.update(_tensors(1))
        session.connect(["http://a"])  # http://b dropped: paused, whole, still ours
        report = session.abort()
        assert report.outcomes["http://b"].startswith("resumed")
        assert engines["http://b"].running
        assert torn.paused and report.left_paused == ["http://a"]
        session.update(_tensors(2))
    assert _holds(torn, 2) and torn.running


def test_long_steps_show_progress_when_asked(engines, capsys):
    """Connect (replicas), the first update's probe and the writes draw bars on stderr where
    progress is on (a terminal, or forced); off by default in tests (no terminal)."""
    from p2pweights.progress import set_progress

    set_progress(True)
    try:
        with WeightSyncSession(CONFIG) as session:
            session.connect(["http://e0"])
            session.update(_tensors(1))
    finally:
        set_progress(None)
    drawn = capsys.readouterr().err
    for step in ("building replicas", "probing sglang's loaders", "p2pweights update"):
        assert step in drawn


def test_the_weight_check_is_not_repeated_after_a_reconnect(engines):
    config = SyncConfig(buffer_bytes="1MiB", verify_with_weight_checker=True)
    with WeightSyncSession(config) as session:
        session.connect(["http://e0"])
        session.update(_tensors(0))  # the start weights: checked once
        session.update(_tensors(5))
        session.connect(["http://e0", "http://e1"])
        session.update(_tensors(6))  # trained weights: not compared with the old snapshot
    assert engines["http://e0"].events.count("compare") == 1
    assert _holds(engines["http://e0"], 6) and _holds(engines["http://e1"], 6)


def test_a_first_update_that_failed_to_prepare_is_prepared_again(engines):
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        with pytest.raises(ConfigError):
            session.update([*_tensors(1), ("q", torch.zeros(2, dtype=torch.uint8))])
        assert session._connection.prepared is None
        session.update(_tensors(2))
    assert _holds(engines["http://e0"], 2)


def test_the_report_says_how_long_each_engine_stood_paused(engines):
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0", "http://e1"])
        report = session.update(_tensors(1))
        assert set(report.paused_s) == {"http://e0", "http://e1"}
        assert all(0 <= s <= report.seconds for s in report.paused_s.values())
        assert "paused" in report.summary()
        again = session.update(_tensors(2))
    assert set(again.paused_s) == {"http://e0", "http://e1"} and _holds(engines["http://e1"], 2)


def test_bad_input_of_a_later_update_says_the_engines_were_not_touched(engines):
    """Found in a new-user trial: a first update's bad input said "nothing was sent", a
    later one's said nothing of the engines."""
    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB")) as session:
        session.connect(["http://e0"])
        session.update(_tensors(5))
        engine = engines["http://e0"]
        before = list(engine.events)
        bad = dict(_tensors(6))
        bad["o"] = torch.zeros(3, dtype=torch.uint8)
        with pytest.raises(ConfigError, match="No engine was paused or written"):
            session.update(bad)
        assert engine.events == before and engine.running


def test_engines_a_first_update_s_weight_check_never_compared_are_not_resumed_as_new(engines):
    """With ``verify_with_weight_checker`` the first update is whole only once the engines'
    own check passed: a write failing on another engine stops the update before it, so
    the engine that got every byte is not resumed under the new version either."""
    _fail_once(engines, "http://bad", "write2", "failed", True)
    config = SyncConfig(buffer_bytes="1MiB", verify_with_weight_checker=True)
    with WeightSyncSession(config) as session:
        session.connect(["http://bad", "http://good"])
        with pytest.raises(TransferError, match="http://bad rank 0"):
            session.update(_tensors(0))
        report = session.abort()
        assert sorted(report.left_paused) == ["http://bad", "http://good"], report
        assert "not verified" in report.outcomes["http://good"]
        session.update(_tensors(0))  # the retry compares and resumes both
    assert engines["http://good"].running and engines["http://bad"].running
