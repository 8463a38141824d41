"""An engine rank a write given up on may still land in stays torn: no later update
writes it or reports it whole, and abort() leaves it paused, until the write ended
(the fake engines, replicas and transport of test_session_sequence: unit level only)."""

from __future__ import annotations

import ctypes

import pytest
from test_session_sequence import (  # the fixture is used by name
    CONFIG,
    FakeTransport,
    _holds,
    _tensors,
    engines,  # noqa: F401
)

from p2pweights import TransferError, WeightSyncSession
from p2pweights import sync_connection as connection_module
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import UnsettledWrite

STUCK, GOOD = "http://stuck", "http://good"


class StuckTransport(FakeTransport):
    """The first write to ``STUCK`` is given up on still in flight: its bytes (as they
    were when it was issued) land only once the test lets them, and it settles then."""

    def __init__(self, fakes):
        super().__init__(fakes)
        self.stale: list[tuple[int, bytes]] | None = None
        self.may_land = False
        self.landed = False

    def write(self, target, writes, timeout_s):
        if target.engine_url != STUCK or self.stale is not None:
            return super().write(target, writes, timeout_s)
        self.engines[STUCK].writes += 1
        self.stale = [(w.dst_address, ctypes.string_at(w.src_address, w.num_bytes)) for w in writes]
        raise UnsettledWrite(f"engine {STUCK} rank 0: not done; it may land later", self.settle)

    def settle(self, timeout_s: float) -> bool:
        if self.may_land and not self.landed:
            assert self.stale is not None
            for dst, data in self.stale:
                ctypes.memmove(dst, data, len(data))
            self.landed = True
        return self.landed


@pytest.fixture
def transport(engines, monkeypatch):  # noqa: F811
    transport = StuckTransport(engines)
    monkeypatch.setattr(connection_module, "create_transport", lambda config: transport)
    return transport


def test_an_engine_rank_with_a_write_in_flight_is_never_reported_whole(engines, transport):  # noqa: F811
    with WeightSyncSession(CONFIG) as session:
        session.connect([STUCK, GOOD])
        with pytest.raises(TransferError, match=r"http://stuck rank 0 .*may land later"):
            session.update(_tensors(1))
        stuck, good = engines[STUCK], engines[GOOD]
        assert _holds(good, 1) and stuck.version.startswith(UPDATING_PREFIX)
        report = session.abort()
        assert report.left_paused == [STUCK] and good.running
        # the stale write may still land: the next update refuses before any engine pauses
        good_events = len(good.events)
        with pytest.raises(
            TransferError, match=r"engine http://stuck rank 0 parameters qkv: .*still in flight"
        ):
            session.update(_tensors(2))
        assert stuck.paused and stuck.version.startswith(UPDATING_PREFIX)
        assert good.running and not [e for e in good.events[good_events:] if e == "pause"]
        assert session.abort().left_paused == [STUCK]
        assert stuck.paused and stuck.version.startswith(UPDATING_PREFIX)
        # once it landed (the engine thawed), the next update rewrites it whole over it
        transport.may_land = True
        session.update(_tensors(3))
        assert _holds(stuck, 3) and _holds(good, 3) and stuck.running and good.running
        assert stuck.violations == [] and good.violations == []
