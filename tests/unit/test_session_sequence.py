"""The session's sequencing, with fakes that record the order of events (unit level only).

The engines' HTTP client, the replicas and the transport are replaced by recorders;
real engines and transports are exercised in tests/integration.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import pytest
import torch

from p2pweights import ConfigError, SyncConfig, TransferError, WeightSyncSession
from p2pweights import session as session_module
from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectedEngine, Fleet
from p2pweights.engines.published import RankPublication, WeightRegion
from p2pweights.source.checkpoint_format import AS_GIVEN
from p2pweights.source.inputs import ParamGroup
from p2pweights.transfer.buffers import staged_bytes

PARAMS = {"qkv": 64, "o": 32}
GROUPS = [ParamGroup(frozenset({"q", "k", "v"}), ("qkv",)), ParamGroup(frozenset({"o"}), ("o",))]


@dataclass
class Recorder:
    events: list[str] = field(default_factory=list)
    fail_writes: int = 0
    version: str = "default"


class FakeClient:
    def __init__(self, url: str, rec: Recorder):
        self.url, self.rec = url, rec

    def __getattr__(self, route):
        def call(*args, **kwargs):
            self.rec.events.append(f"{route}{list(args) if args else ''}")
            if route == "update_weight_version":
                self.rec.version = args[0]
            return {"success": True}

        return call

    def weight_version(self):
        return self.rec.version

    def close(self):
        pass


class FakeHandle:
    key = "layout"
    spec = "tp1"

    def check_published(self, pub):
        pass

    def check_writable(self, groups, pubs):
        pass

    def checkpoint_format(self, specs):
        return AS_GIVEN

    def groups(self, specs):
        return GROUPS

    def group_sizes(self, group):
        return {p: PARAMS[p] for p in group.param_names}

    def group_bytes(self, group):
        return staged_bytes(self.group_sizes(group).values())

    def load_into(self, inputs, views):
        for view in views.values():
            view.fill_(len(inputs))


class FakeTransport:
    def __init__(self, rec: Recorder):
        self.rec = rec

    def register(self, buffer):
        self.rec.events.append("register")

    def connect(self, pub):
        pass

    def write(self, target, writes, timeout_s):
        self.rec.events.append(f"write x{len(writes)}")
        if self.rec.fail_writes:
            self.rec.fail_writes -= 1
            raise TransferError(f"engine {target.engine_url} rank 0: refused")
        for w in writes:
            ctypes.memmove(w.dst_address, w.src_address, w.num_bytes)

    def close(self):
        pass


@pytest.fixture
def rec(monkeypatch) -> Recorder:
    rec = Recorder()
    memory = {n: torch.zeros(size, dtype=torch.uint8) for n, size in PARAMS.items()}
    rec.memory = memory  # type: ignore[attr-defined]

    def fake_connect(endpoints, kind, timeout_s, api_key):
        engines = []
        for i, endpoint in enumerate(endpoints):
            regions = {n: WeightRegion(t.data_ptr(), t.numel()) for n, t in memory.items()}
            pub = RankPublication(endpoint.url, 0, kind, regions, session_id="s")
            engines.append(
                ConnectedEngine(i, endpoint, FakeClient(endpoint.url, rec), {"tp_size": 1}, [pub])
            )
        return Fleet(engines)

    monkeypatch.setattr(fleet_module.Fleet, "connect", staticmethod(fake_connect))
    monkeypatch.setattr(session_module, "replica_for", lambda *a: FakeHandle())
    monkeypatch.setattr(session_module, "create_transport", lambda config: FakeTransport(rec))
    return rec


def _tensors():
    return [(n, torch.ones(2)) for n in ("q", "k", "v", "o")]


def _control(events):
    return [e for e in events if not e.startswith(("write", "register"))]


def test_update_session_order(rec):
    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB")) as session:
        session.connect(["http://e0/"])
        report = session.update(_tensors())
    assert _control(rec.events) == [
        "pause_generation['retract']",
        "flush_cache",
        "begin_weight_update['all']",
        "update_weight_version['1']",
        "end_weight_update",
        "continue_generation",
    ]
    assert rec.events.count("register") == 2  # two staging buffers, once
    assert report.bytes_by_target == {("http://e0", 0): 96}
    # one load call for the whole buffer got all four inputs, and the bytes were written
    assert rec.memory["qkv"].tolist() == [4] * 64
    assert rec.memory["o"].tolist() == [4] * 32


def test_check_snapshots_once_and_compares_once(rec):
    config = SyncConfig(buffer_bytes="1MiB", check_weight_update_equal=True, pause_mode="in_place")
    with WeightSyncSession(config) as session:
        session.connect(["http://e0"])
        session.update(_tensors())
        session.update(_tensors())
    control = _control(rec.events)
    assert control.count("weights_checker['snapshot']") == 1
    assert control.count("weights_checker['compare']") == 1
    assert "flush_cache" not in control  # in_place keeps requests; sglang cannot flush then
    assert control.index("weights_checker['reset_tensors']") < control.index(
        "begin_weight_update['all']"
    )


def test_failed_write_keeps_session_open_and_retry_resumes(rec):
    rec.fail_writes = 1
    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB")) as session:
        session.connect(["http://e0"])
        with pytest.raises(TransferError, match="http://e0 rank 0"):
            session.update(_tensors())
        assert "update_weight_version['1']" not in rec.events
        rec.events.clear()
        report = session.update(_tensors())
    # no second pause/begin: the engines are still inside the session the failure left open
    assert _control(rec.events) == [
        "update_weight_version['1']",
        "end_weight_update",
        "continue_generation",
    ]
    assert report.version == "1"


def test_versions_continue_from_the_engine_and_never_go_back(rec):
    rec.version = "41"
    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB")) as session:
        session.connect(["http://e0"])
        assert session.update(_tensors()).version == "42"
        assert session.update(_tensors(), version="7").version == "7"
        assert session.update(_tensors()).version == "43"
        assert session.update(_tensors(), version="step-9").version == "step-9"
        assert session.update(_tensors()).version == "44"


def test_other_rank_failure_fails_this_rank(rec):
    votes = iter([True, False])  # open agreed; another rank's write failed
    config = SyncConfig(buffer_bytes="1MiB", trainer_rank=1, num_trainer_ranks=2)
    with WeightSyncSession(config, agree=lambda ok: ok and next(votes)) as session:
        session.connect(["http://e0"])
        with pytest.raises(TransferError, match="another trainer rank failed the 'write' step"):
            session.update(_tensors())
    assert _control(rec.events) == []  # only trainer rank 0 drives the engines


def test_usage_errors(rec):
    with pytest.raises(ConfigError, match="agree="):
        WeightSyncSession(SyncConfig(num_trainer_ranks=2))
    session = WeightSyncSession(SyncConfig(buffer_bytes="1MiB"))
    with pytest.raises(ConfigError, match="connect"):
        session.update(_tensors())
    with pytest.raises(ConfigError, match="once"):
        session.connect(["http://e0", EngineEndpoint("http://e0/")])
    session.close()
