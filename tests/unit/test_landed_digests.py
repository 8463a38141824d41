"""Digests taken as writes land (``SyncConfig.digest_as_written``): the sender flags each
parameter once its writes into an engine rank landed (``wire.landed``), the rank digests
it while the rest is written (``engine_side.landed``), and only the last flush's
parameters are read inside ``end_weight_update``.

The engine side on its own, then whole updates against test_verified_writes' fake
engines, here publishing a flags region as the local engine and the plugin do."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch
from test_session_sequence import FakeEngine, _holds, _tensors
from test_verified_writes import DigestClient, DigestEngine, engines  # noqa: F401

from p2pweights import DeltaConfig, SyncConfig, TransferError, WeightSyncSession
from p2pweights.engine_side.steps import RankSide
from p2pweights.engines import fleet as fleet_module
from p2pweights.wire.digest import digests
from p2pweights.wire.landed import LANDED_NAME, flag_bytes, flag_names
from p2pweights.wire.publication import WeightRegion


def _params() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((4096,), i, dtype=torch.uint8) for i in range(5)}


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_flag_order_is_the_sorted_parameter_names_without_special_regions():
    names = ["b", "a", LANDED_NAME, "__p2pweights_delta_scratch__", "c"]
    assert flag_names(names) == ["a", "b", "c"]
    assert flag_bytes(0) == 64 and flag_bytes(64) == 64 and flag_bytes(65) == 128


def test_a_rank_digests_flagged_parameters_while_the_session_is_open():
    params = _params()
    flags = torch.full((64,), 7, dtype=torch.uint8)  # an earlier session's: cleared at begin
    side = RankSide(0, write_digests=True)
    side.after_begin(None, (flags, params))
    assert int(flags.sum()) == 0
    early = side._early
    assert early is not None
    flags[[0, 2]] = 1  # w0 and w2 landed
    _wait_for(lambda: set(early.found) == {"w0", "w2"})
    params["w4"][0] = 99  # not flagged: digested at the end, as it is then
    record = side.before_end({**params, LANDED_NAME: flags})
    assert record["digests"] == digests(params)
    assert record["digested_early"] == 2 and side._early is None


def test_a_byte_changed_after_its_flag_is_not_seen_one_before_it_is():
    """What digesting early gives up, pinned: bytes a parameter gets after its flag."""
    params = _params()
    flags = torch.zeros(64, dtype=torch.uint8)
    side = RankSide(0, write_digests=True)
    side.after_begin(None, (flags, params))
    flags[1] = 1
    assert side._early is not None
    _wait_for(lambda: "w1" in side._early.found)  # type: ignore[union-attr]
    before = digests({"w1": params["w1"]})["w1"]
    params["w1"][5] ^= 1  # after its digest
    record = side.before_end(params)
    assert record["digests"]["w1"] == before != digests({"w1": params["w1"]})["w1"]


def test_without_flags_or_digests_nothing_runs_early():
    params = _params()
    flags = torch.zeros(64, dtype=torch.uint8)
    off = RankSide(0, write_digests=False)
    off.after_begin(None, (flags, params))
    assert off._early is None
    plain = RankSide(0, write_digests=True)
    plain.after_begin()
    assert plain._early is None
    assert plain.before_end(params)["digested_early"] == 0


def test_a_new_session_stops_an_earlier_sessions_thread():
    params = _params()
    flags = torch.zeros(64, dtype=torch.uint8)
    side = RankSide(0, write_digests=True)
    side.after_begin(None, (flags, params))
    first = side._early
    side.after_begin(None, (flags, params))  # its end never came
    assert first is not None and not first._thread.is_alive() and side._early is not first
    side.before_end(params)
    assert side._early is None


def test_the_thread_ends_once_every_parameter_is_digested():
    params = _params()
    flags = torch.zeros(64, dtype=torch.uint8)
    side = RankSide(0, write_digests=True)
    side.after_begin(None, (flags, params))
    early = side._early
    assert early is not None
    flags[:5] = 1
    _wait_for(lambda: not early._thread.is_alive())
    assert side.before_end(params)["digested_early"] == 5


# -- whole updates against fake engines ---------------------------------------------------------


@dataclass
class FlaggingEngine(DigestEngine):
    """A fake engine whose rank publishes a flags region and digests as flags arrive."""

    flags: torch.Tensor = field(default_factory=lambda: torch.zeros(64, dtype=torch.uint8))

    def begin(self) -> None:
        FakeEngine.begin(self)
        self.side = self.side or RankSide(0, write_digests=True)
        landed = (self.flags, self.memory)
        self.record = self.side.after_begin(None, landed) | {"weight_version": self.version}


class FlaggingClient(DigestClient):
    def publication(self, rank, role="target"):
        pub = super().publication(rank, role)
        flags = WeightRegion(self.engine.flags.data_ptr(), self.engine.flags.numel())
        pub.regions[LANDED_NAME] = flags
        return pub


@pytest.fixture
def flagging(engines, monkeypatch):  # noqa: F811
    made = fleet_module.EngineClient

    def client_for(url, **kwargs):
        engine = engines.get(url)
        if isinstance(engine, FlaggingEngine):
            return FlaggingClient(engine)
        return made(url, **kwargs)

    monkeypatch.setattr(fleet_module, "EngineClient", client_for)
    return engines


AS_WRITTEN = SyncConfig(buffer_bytes="1MiB", digest_as_written=True)


def test_the_first_flushs_parameters_are_digested_before_the_end(flagging):
    engine = flagging.setdefault("http://e0", FlaggingEngine("http://e0"))
    with WeightSyncSession(AS_WRITTEN) as session:
        session.connect(["http://e0"])
        report = session.update(_tensors(3))
        assert engine.record is not None and engine.record["digested_early"] == 1  # qkv
        assert engine.flags[:2].tolist() == [0, 1]  # flag order: "o", "qkv"; o was last
        session.update(_tensors(4))  # flags cleared at begin, set again
        assert engine.record["digested_early"] == 1
    assert report.engines["http://e0"].verified_by == ("write_digests",)
    assert _holds(engine, 4) and engine.running


def test_off_by_default_the_engine_digests_everything_at_its_end(flagging):
    engine = flagging.setdefault("http://e0", FlaggingEngine("http://e0"))
    assert SyncConfig().digest_as_written is False
    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB")) as session:
        session.connect(["http://e0"])
        session.update(_tensors(3))
    assert engine.record is not None and engine.record["digested_early"] == 0
    assert int(engine.flags.sum()) == 0


def test_a_byte_changed_in_the_last_flush_is_still_found(flagging):
    flagging.setdefault("http://e0", FlaggingEngine("http://e0", corrupt_at_end="o"))
    with WeightSyncSession(AS_WRITTEN) as session:
        session.connect(["http://e0"])
        with pytest.raises(TransferError, match=r"engine http://e0 rank 0: 1 of 2 .*'o'"):
            session.update(_tensors(3))


def test_delta_updates_write_no_flags(flagging):
    engine = flagging.setdefault("http://e0", FlaggingEngine("http://e0"))
    config = AS_WRITTEN.model_copy(update={"delta": DeltaConfig(mode="always")})
    with WeightSyncSession(config) as session:
        session.connect(["http://e0"])
        session.update(_tensors(3))
    assert int(engine.flags.sum()) == 0


@pytest.mark.parametrize(("entries", "kept"), [(0, True), (3, False)])
def test_a_delta_applied_at_the_end_voids_the_early_digests(entries, kept):
    """A full update's header (no entries) changes nothing; a delta's entries do."""
    from p2pweights.engine_side.steps import BeforeEnd, record_digests

    params = _params()
    record = {"delta": {"entries": entries}}
    context = BeforeEnd(0, "target", params, 1, True, {"w0": "taken early"}, record)
    record_digests(context)
    assert (context.record["digests"]["w0"] == "taken early") is kept
    assert context.record["digested_early"] == (1 if kept else 0)
